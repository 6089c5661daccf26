"""The gpt2 family (GPT-2 shapes): `config` (its fields, no jax) and `family` (`FAMILY`, the functions
meshrun drives: `meshrun_models.gpt2.model` behind `Family`)."""
