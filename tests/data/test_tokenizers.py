import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpclip.data import load_data
from dpclip.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer
from dpclip.errors import DpclipError
from dpclip.recipe.schema import FilesData


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text_including_non_ascii(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_byte_tokenizer_encodes_utf8_bytes_and_pads_on_the_right():
    tokenizer = ByteTokenizer()
    ids, mask = tokenizer.encode_batch(["é", "abc"], max_length=6)
    assert ids.dtype == mask.dtype == torch.int64
    assert ids[0].tolist() == [257, 0xC3, 0xA9, 258, 256, 256]
    assert mask[0].tolist() == [1, 1, 1, 1, 0, 0] and mask[1].tolist() == [1] * 5 + [0]


def test_byte_tokenizer_truncation_keeps_the_beginning_and_decodes_without_error():
    tokenizer = ByteTokenizer()
    ids, mask = tokenizer.encode_batch(["naïve café"], max_length=4)
    assert mask.tolist() == [[1] * 4]
    assert ids[0, 0] == tokenizer.bos_token_id and tokenizer.eos_token_id not in ids[0].tolist()
    # bos, "n", "a" and the first of the two bytes of "ï" survive; half a character is U+FFFD.
    assert tokenizer.decode(ids[0]) == "na\ufffd"


@pytest.fixture
def local_hf_tokenizer_dir(tmp_path):
    """A word-level tokenizer without a pad token, saved like a downloaded one (no network)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.train_from_iterator(["the cat sat on the mat", "a dog ran"],
                             trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="</s>")
    wrapped.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def test_local_hf_tokenizer_loads_offline_and_pads_with_eos_when_it_has_no_pad_token(local_hf_tokenizer_dir):
    tokenizer = load_tokenizer(str(local_hf_tokenizer_dir))
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id is not None
    ids, mask = tokenizer.encode_batch(["the cat", "a dog ran on the mat again"], max_length=4)
    assert ids.shape == mask.shape == (2, 4)
    assert mask[0].tolist() == [1, 1, 0, 0] and mask[1].tolist() == [1, 1, 1, 1]
    assert ids[0, 2:].tolist() == [tokenizer.pad_token_id] * 2
    assert tokenizer.decode(ids[0]) == "the cat"


def test_text_file_tokenized_with_a_local_hf_tokenizer_masks_padding_by_the_attention_mask(
        tmp_path, local_hf_tokenizer_dir):
    path = tmp_path / "train.txt"
    path.write_text("the cat sat\na dog\nthe mat\nthe dog sat on the mat\n")
    data = load_data(FilesData(source="files", format="text", train=str(path), test=str(path),
                               tokenizer=str(local_hf_tokenizer_dir), max_length=5), seed=0)
    labels, mask = data.train["labels"], data.train["attention_mask"]
    # The pad id equals the eos id here, so only the mask can tell padding apart.
    assert (labels[mask == 0] == -100).all() and (labels[mask == 1] >= 0).all()
    assert data.vocab_size == len(data.tokenizer.hf_tokenizer)


def test_a_tokenizer_that_is_neither_byte_nor_local_is_a_clear_error(tmp_path):
    with pytest.raises(DpclipError) as info:
        load_tokenizer(str(tmp_path / "no-such-tokenizer"))
    assert "no-such-tokenizer" in info.value.message and "byte" in info.value.hint
