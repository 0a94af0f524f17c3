"""A slice of the ONNX node suite through compiled native code (the full native run takes a few
minutes: `python -m tests.conformance.run_suite --engine native`)."""

from __future__ import annotations

import pytest

from tests.conformance.suite import run_suite

NATIVE_MUST_PASS = (
    "test_relu",
    "test_clip",
    "test_conv_with_strides_padding",
    "test_basic_conv_with_padding",
    "test_gemm_default_single_elem_vector_bias",
    "test_matmul_4d",
    "test_maxpool_2d_pads",
    "test_averagepool_2d_ceil",
    "test_globalaveragepool",
    "test_softmax_axis_1",
    "test_layer_normalization_4d_axis1",
    "test_transpose_all_permutations_3",
    "test_concat_3d_axis_negative_1",
    "test_gather_negative_indices",
    "test_resize_upsample_scales_linear",
    "test_attention_4d_causal",
    "test_sce_mean_weight",
    "test_argmax_keepdims_example",
    "test_bitshift_right_int32_shift_ge_width",
    "test_div_int32_trunc",
    # One case per kernel family added with the native long tail:
    "test_bitcast_float32_to_int32",
    "test_cast_FLOAT_to_BFLOAT16",
    "test_celu_bfloat16",
    "test_dynamicquantizelinear_min_adjusted",
    "test_mvn",
    "test_tensorscatter_circular",
    "test_maxpool_with_argmax_2d_precomputed_strides",
    "test_convinteger_with_padding",
    "test_qlinearconv",
    "test_quantizelinear_blocked_asymmetric",
    "test_einsum_batch_diagonal",
    "test_roialign_mode_max",
    "test_det_nd",
    "test_deform_conv_with_mask_bias",
    "test_dft_irfft",
    # Reductions over an empty axis: the initial value alone, no reduction loop to tile.
    "test_reduce_sum_empty_set",
    "test_reduce_max_empty_set",
    "test_reduce_log_sum_exp_empty_set",
    "test_stft_with_window",
    "test_lstm_with_peepholes",
    "test_gru_seq_length",
    "test_simple_rnn_bidirectional",
    "test_rnn_seq_length",
    "test_linear_attention_gated_delta_gqa",
    "test_linear_attention_prefill_with_past",
    # The preview domain: FlexAttention's modifier graphs inlined, grouped heads as GEMM rows.
    "test_flexattention_causal_mask",
    "test_flexattention_gqa",
    "test_col2im_dilations",
    "test_col2im_5d",
    # Control flow: Scan as one native loop, Loop unrolled (its Slice bounds are the
    # iteration number), If with a run-time condition.
    "test_scan_sum",
    "test_scan9_sum",
    "test_scan9_multi_state",
    "test_scan9_scalar",
    "test_loop11",
    "test_if",
    # Optionals, decided at import.
    "test_optional_get_element_tensor",
    "test_optional_has_element_empty_no_input_name_optional_input",
    "test_batchnorm_example_training_mode",
    "test_tfidfvectorizer_tf_batch_uniandbigrams_skip5",
)


@pytest.fixture(scope="module")
def report():
    pattern = "^(" + "|".join(NATIVE_MUST_PASS) + ")$"
    return run_suite(workers=2, pattern=pattern, engine="native")


@pytest.mark.parametrize("name", NATIVE_MUST_PASS)
def test_native_case_passes(report, name):
    result = report["results"][name]
    assert result["status"] == "passed", f"{name}: {result['reason']}"
