"""The llama family (Llama, Mistral, Qwen2, Mixtral shapes): `config` (its fields, no jax) and `family`
(`FAMILY`, the functions meshrun drives: `meshrun_models.transformer` behind `Family`)."""
