"""Sentinel values in tokenized rows, shared by the data pipeline and the trainer.

No torch here: Ray Data's tokenizer tasks import this, and a process that never loads
torch starts tokenizing seconds sooner (mlplat.data.ingest.tokenize_rows).
"""

IGNORE_INDEX = -100  # label of a token that is not trained on (torch cross_entropy's default ignore_index)
PAD_SEQ_ID = -1  # seq_ids of padding in packed rows (mlplat.data.packing)
