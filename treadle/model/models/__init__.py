"""One module per model family; treadle/model/registry.py lists them."""
