"""Router backends: one class per kind of thing a model name can be served by."""
