"""Training components shared by the recipes in ``train_apps/``."""
