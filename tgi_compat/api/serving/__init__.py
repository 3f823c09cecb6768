"""What a request goes through: validation, tokenization, generation, detokenization, chat templates, accounting."""
