"""Stock upstream models the bed builds: tiny GPT / hybrid / LLaVA, Bridge-built models, pipeline stages,
and the packed (THD) batches they train on."""
