"""Recipes: one readable Ray Train job per algorithm (``python -m train_apps.sft``)."""
