"""Other formats in and out: Hugging Face checkpoints (`jaxpar.interop.hf`)."""
