"""Finetune Hugging Face causal LMs on one CPU or many GPUs."""

__version__ = "0.1.0"
