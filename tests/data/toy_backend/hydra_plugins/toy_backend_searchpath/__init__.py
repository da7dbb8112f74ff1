"""Puts toy_backend's config (conf/backend/toy.yaml) on Hydra's search path: how a plugin backend
gives `backend=toy` its options without a file in parabench's conf/."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class ToyBackendSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="toy-backend", path="pkg://toy_backend.conf")
