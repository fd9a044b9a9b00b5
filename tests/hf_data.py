"""A Hugging Face user's data, built locally for the tests (nothing downloaded): a tiny
corpus, a word-level tokenizer trained on it with the ``tokenizers`` library and wrapped as a
transformers ``PreTrainedTokenizerFast``, ``datasets.Dataset``s tokenized with it (the text
column kept, as a user's is), the three collators, and tiny BERTs built from configs.

Import it after ``pytest.importorskip("datasets")`` (and ``"transformers"``)."""

from __future__ import annotations

import functools

import datasets
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

datasets.disable_progress_bars()

WORDS = ("the cat dog bird sat ran flew on under over a mat tree roof and then "
         "good bad fine poor").split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
ROWS = 24


def corpus(rows: int = ROWS, seed: int = 0) -> tuple[list[str], list[int]]:
    """Sentences of 2..9 words and a label each: 1 where "good" or "fine" occurs."""
    g = torch.Generator().manual_seed(seed)
    texts, labels = [], []
    for _ in range(rows):
        n = int(torch.randint(2, 10, (), generator=g))
        words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g)]
        texts.append(" ".join(words))
        labels.append(int("good" in words or "fine" in words))
    return texts, labels


@functools.cache
def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer trained on the corpus, adding [CLS] ... [SEP] as BERT's does."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus()[0] + [" ".join(WORDS)],
                            trainers.WordLevelTrainer(special_tokens=SPECIALS))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]")


def _tags(row: dict) -> dict:
    """One tag per token (a word's index mod 3), -100 on [CLS] and [SEP]."""
    ids = row["input_ids"]
    return {"labels": [-100] + [i % 3 for i in ids[1:-1]] + [-100]}


@functools.cache
def dataset(task: str, rows: int = ROWS, seed: int = 0) -> datasets.Dataset:
    """The corpus as a ``datasets.Dataset`` with its ``text`` column, tokenized for ``task``:
    ``"classify"`` (a ``label`` column), ``"mlm"`` (no label: the collator masks) or
    ``"tag"`` (a ``labels`` column per token)."""
    texts, labels = corpus(rows, seed)
    columns: dict[str, list] = {"text": texts}
    if task == "classify":
        columns["label"] = labels
    ds = datasets.Dataset.from_dict(columns)
    ds = ds.map(lambda b: tokenizer()(b["text"]), batched=True)
    return ds.map(_tags) if task == "tag" else ds


def collator(task: str):
    """The collator a user takes for ``task``."""
    tok = tokenizer()
    if task == "classify":
        return transformers.DataCollatorWithPadding(tok)
    if task == "mlm":
        return transformers.DataCollatorForLanguageModeling(tok, mlm_probability=0.3)
    return transformers.DataCollatorForTokenClassification(tok)


def model(task: str, dropout: float = 0.0) -> torch.nn.Module:
    """A tiny BERT for ``task``, from a config (seeded)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(tokenizer()), hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=24, max_position_embeddings=16,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        num_labels=2 if task == "classify" else 3)
    cls = {"classify": transformers.BertForSequenceClassification,
           "mlm": transformers.BertForMaskedLM,
           "tag": transformers.BertForTokenClassification}[task]
    return cls(config)


# What each task's loss averages over (compile's loss_items)
LOSS_ITEMS = {"classify": None, "mlm": "tokens", "tag": "tokens"}
