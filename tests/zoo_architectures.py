"""The Hugging Face architectures the zoo trains in every CI run (`tests/test_zoo.py`): dense
ones, and mixtures of experts. The corpus (`tests/test_corpus.py`) leaves them out of its CI
sample: training them under tensor and sequence parallelism says more than planning them."""
from __future__ import annotations

DENSE = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "opt", "gpt_neox",
         "gptj", "phi", "starcoder2", "granite", "stablelm", "olmo", "olmo2", "smollm3", "cohere", "falcon", "bloom",
         "gpt_neo", "codegen", "persimmon", "nemotron", "helium", "glm", "biogpt", "xglm", "gpt_bigcode", "mpt",
         "exaone4", "internlm3", "ernie4_5", "seed_oss")
MOE = ("mixtral", "qwen3_moe", "deepseek_v3")
