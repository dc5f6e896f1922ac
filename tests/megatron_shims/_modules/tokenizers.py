"""SHIM (tests only) for ``megatron/core/tokenizers/__init__.py`` (imports the tokenizer back
ends, which need the model's files): ``MegatronTokenizer.from_pretrained`` builds a small
Hugging Face fast tokenizer in memory, whatever path it is given.

It is Megatron's ``MegatronTokenizerText`` over its Hugging Face library as the server reads
it: ``tokenize`` / ``detokenize``, ``bos`` / ``eod`` / ``eos_id``, ``apply_chat_template``,
and ``_tokenizer.tokenizer``, a ``transformers.PreTrainedTokenizerFast`` (the streaming path
wants one). Its vocabulary is the stand-in engine's (``discovery.testing.stand_in_coordinator``):
id 0 is EOD, 1 is BOS, every other id below 127 is the character of that code point, so text
decoded here reads as the stand-in's ``generated_text``.
"""

from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOD, BOS, UNK = 0, 1, 127
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def _fast_tokenizer() -> Any:
    vocab = {"<eod>": EOD, "<s>": BOS, "<unk>": UNK}
    vocab.update({chr(i): i for i in range(2, UNK)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="<eod>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


class _HuggingFaceLibrary:
    """Megatron's ``HuggingFaceTokenizer`` as far as the server reaches it: ``.tokenizer``."""

    def __init__(self) -> None:
        self.tokenizer = _fast_tokenizer()


class MegatronTokenizerText:
    """Megatron's text tokenizer over the in-memory Hugging Face one."""

    def __init__(self, path: str, config: dict) -> None:
        self.path = path
        self.config = config
        self._tokenizer = _HuggingFaceLibrary()

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.tokenizer.encode(text, add_special_tokens=False)

    def detokenize(self, ids: list[int], skip_special_tokens: bool | None = None) -> str:
        return self._tokenizer.tokenizer.decode(ids, skip_special_tokens=bool(skip_special_tokens))

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        return self._tokenizer.tokenizer.apply_chat_template(conversation, **kwargs)

    @property
    def vocab_size(self) -> int:
        return UNK + 1

    @property
    def bos(self) -> int:
        return BOS

    @property
    def bos_id(self) -> int:
        return BOS

    @property
    def eod(self) -> int:
        return EOD

    @property
    def eos_id(self) -> int:
        return EOD

    @property
    def eos(self) -> int:
        return EOD


class MegatronTokenizer:
    """``MegatronTokenizer.from_pretrained(tokenizer_path, metadata_path)``, as Megatron's."""

    def __init__(self) -> None:
        raise OSError("use MegatronTokenizer.from_pretrained()")

    @staticmethod
    def from_pretrained(
        tokenizer_path: str | None = None, metadata_path: Any = None, **kwargs: Any
    ) -> MegatronTokenizerText:
        config = metadata_path if isinstance(metadata_path, dict) else {"library": "huggingface"}
        return MegatronTokenizerText(tokenizer_path or "", dict(config))


MegatronTokenizerBase = MegatronTokenizerText
