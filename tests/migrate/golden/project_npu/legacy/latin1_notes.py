# -*- coding: latin-1 -*-
name = "café on cuda"
