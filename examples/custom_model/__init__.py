"""A model family outside meshrun: a small residual-MLP language model (`model.py`), trained by
`meshrun train` on any mesh through `model.family: custom_model.model:FAMILY` (see config.yaml)."""
