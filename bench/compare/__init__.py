"""``bench compare``: recorded runs read back from MLflow and put side by side - the report in text,
markdown, CSV and HTML and its own MLflow record (``command``), with bench plan's predictions beside
the measurements (``versus``). The grouping into comparable sections, ratios and scaling efficiency
is the runs table's (:mod:`parabench.runtable`), a building block a sweep's parent run shares."""
