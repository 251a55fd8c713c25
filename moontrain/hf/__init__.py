"""The Hugging Face modeling code of moontrain models (configuration + modeling modules that import only torch
and transformers; `moontrain export` copies them next to the weights for trust_remote_code)."""
