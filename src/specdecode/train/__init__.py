"""Training data, tokenizer and evaluation for the target/draft pair the project trains itself."""
