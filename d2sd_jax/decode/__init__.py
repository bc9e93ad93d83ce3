"""Decoding requests: `Options` and their checks (`options`), compiled runners and batching
(`runner`), the one generation path of decode.py and notebooks (`generate`), method='auto'
(`autoconfig`) and the notebook API (`api`)."""
