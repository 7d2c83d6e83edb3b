"""One weight-map module per model family; `trinity.convert.registry` collects them."""
