"""Files in and out: targets from GGUF or Hugging Face folders (`loaders`), the tokenizer and
chat template (`tokenizer`), our Orbax drafter checkpoints (`checkpoints`), DFlash's drafter
folders (`dflash_format`), either kind of drafter (`drafters`), and prompt / conversation JSONL
files (`conversations`)."""
