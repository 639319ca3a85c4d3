"""Text data that needs no download: a byte-level tokenizer and the Python standard library as a corpus."""
from regattn.data.text import ByteTokenizer, TextCorpus, stdlib_corpus

__all__ = ["ByteTokenizer", "TextCorpus", "stdlib_corpus"]
