"""Merging a partial tune into a weight's tile table (kernels/matmul_triton.py merge_tuned):
the shipped buckets below and above the tuned Ms stay. Before, a tune of 257-1,536 rows
replaced the whole table, its first bucket then covering every M from 1."""

from __future__ import annotations

from detgate.kernels import matmul_triton as mm

SHIPPED = ((1, "a"), (64, "b"), (256, "c"), (512, "d"), (1024, "e"), (8192, "f"))


def test_a_tune_of_middle_buckets_keeps_the_buckets_below_and_above():
    tuned = ((320, "x"), (384, "y"), (512, "y"))
    assert mm.bucket_floor(SHIPPED, 320) == 256
    assert mm.merge_tuned(SHIPPED, tuned) == (
        (1, "a"), (64, "b"), (256, "c"), (320, "x"), (512, "y"), (1024, "e"), (8192, "f"))


def test_the_bucket_a_tune_ends_inside_keeps_its_config_for_the_rest():
    # 640 lies inside (512, 1024]: 641..1024 keep "e"
    assert mm.merge_tuned(SHIPPED, ((640, "x"),)) == (
        (1, "a"), (64, "b"), (256, "c"), (512, "d"), (640, "x"), (1024, "e"), (8192, "f"))


def test_a_full_tune_replaces_the_table_and_neighbours_of_one_config_join():
    tuned = ((1, "a"), (64, "c"), (256, "c"), (8192, "f"))
    assert mm.merge_tuned(SHIPPED, tuned) == ((1, "a"), (256, "c"), (8192, "f"))
    assert mm.merge_tuned(SHIPPED, ()) == SHIPPED
    assert mm.merge_tuned((), ((128, "x"),)) == ((128, "x"),)


def test_a_tuned_bucket_joins_the_shipped_one_of_its_config_next_to_it():
    assert mm.merge_tuned(SHIPPED, ((384, "c"), (512, "z"))) == (
        (1, "a"), (64, "b"), (384, "c"), (512, "z"), (1024, "e"), (8192, "f"))


def test_the_picked_config_follows_the_merged_table():
    merged = mm.merge_tuned(SHIPPED, ((320, "x"),))
    pick = {m: next((c for upper, c in merged if m <= upper), merged[-1][1])
            for m in (1, 2, 200, 257, 320, 321, 600, 9000)}
    assert pick == {1: "a", 2: "b", 200: "c", 257: "x", 320: "x", 321: "d", 600: "e",
                    9000: "f"}
