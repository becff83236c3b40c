"""Datasets as users bring them: files and folders of many formats (sources), rows as
conversations (conversations)."""
