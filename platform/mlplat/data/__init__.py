"""Data: demo datasets and Ray Data ingestion (read, validate, chat template, tokenize)."""
