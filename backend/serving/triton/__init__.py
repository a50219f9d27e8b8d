"""The Triton side: the ``model.py`` adapter, request and response codecs, the response sender, metrics."""
