"""`bench e2e --profile`: the kernel classifier on real kernel names, and the per-step summary."""

import pytest

from barqtrain_bench.profile import (
    CATEGORIES,
    PROFILED_STEPS,
    PROFILER_WARMUP_STEPS,
    KernelTime,
    classify_kernel,
    profile_steps,
    profile_table,
    summarize_kernels,
)

# Kernel names as torch.profiler reports them for PyTorch 2.11 on H100/H200 (cuBLAS, cuDNN,
# FlashAttention, ATen), for Liger's and Unsloth's Triton kernels and for BarqTrain's own.
KERNEL_NAMES = [
    # cuBLAS and CUTLASS GEMMs in bf16 on tensor cores
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
     "_kernel__5x_cublas", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("nvjet_tst_64x64_64x8_2x1_v_bz_splitK_TNT", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, false, "
     "__nv_bfloat16, __nv_bfloat16, true, false, false>(cublasLt::cublasSplitKParams<float>, float const*, "
     "__nv_bfloat16 const*, __nv_bfloat16*, float const*, float const*, __nv_bfloat16 const*)", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>"
     "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8::Params)", "gemm"),
    ("void barqtrain::kernels::(anonymous namespace)::hopper_dequant_gemm_kernel<cutlass::bfloat16_t, 128>"
     "(barqtrain::kernels::DequantGemmParams)", "gemm"),
    # GEMMs in fp32 on the CUDA cores (or TF32)
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>(cutlass_80_simt_sgemm_128x32_8x5_nn_align1"
     "::Params)", "gemm_fp32"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4_execute"
     "_kernel_trt", "gemm_fp32"),
    ("nvjet_sss_tf32_128x256_TNT", "gemm_fp32"),
    ("ampere_sgemm_128x64_tn", "gemm_fp32"),
    # attention
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, true, false, "
     "false, true, true, false, false>(pytorch_flash::Flash_fwd_params)", "attention"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, "
     "Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, "
     "false>(flash::Flash_fwd_params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::arch::"
     "Sm80, cutlass::bfloat16_t, true, false, true, 64, 64, 64, false>::Params)", "attention"),
    ("void barqtrain::kernels::attention::attention_forward_sm90_kernel<cutlass::bfloat16_t, 128, true>"
     "(barqtrain::kernels::attention::AttentionParams)", "attention"),
    ("void barqtrain::kernels::attention::(anonymous namespace)::rotate_rows_kernel<__nv_bfloat16>"
     "(barqtrain::kernels::attention::RotationParams)", "attention"),
    # norms, activations, RoPE
    ("_rms_layernorm_forward", "norm_act_rope"),
    ("_rms_norm_backward_kernel", "norm_act_rope"),
    ("_fg_kernel", "norm_act_rope"),
    ("_DWf_DW_dfg_kernel", "norm_act_rope"),
    ("_swiglu_forward_kernel", "norm_act_rope"),
    ("_rope_embedding", "norm_act_rope"),
    ("_triton_rope", "norm_act_rope"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel("
     "at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#5}::operator()() const::{lambda("
     "c10::BFloat16)#1}, std::array<char*, 2ul> >(int, at::native::(anonymous namespace)::silu_kernel("
     "at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#5}::operator()() const::{lambda("
     "c10::BFloat16)#1}, std::array<char*, 2ul>)", "norm_act_rope"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
     "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#4}::operator()() const::{lambda("
     "c10::BFloat16)#1}, std::array<char*, 2ul> >(int, ...)", "norm_act_rope"),
    ("void barqtrain::kernels::(anonymous namespace)::norm_forward_kernel<__nv_bfloat16, 8, 1, false, true>"
     "(barqtrain::kernels::NormForwardParams)", "norm_act_rope"),
    ("void barqtrain::kernels::(anonymous namespace)::reduce_partials_kernel<__nv_bfloat16>"
     "(barqtrain::kernels::ReducePartialsParams)", "norm_act_rope"),
    ("void barqtrain::kernels::(anonymous namespace)::glu_backward_kernel<__nv_bfloat16, 8, true>"
     "(barqtrain::kernels::GluBackwardParams)", "norm_act_rope"),
    ("void barqtrain::kernels::(anonymous namespace)::rope_kernel<__nv_bfloat16, 8>"
     "(barqtrain::kernels::RopeParams)", "norm_act_rope"),
    # losses
    ("_cross_entropy_forward", "loss"),
    ("_chunked_cross_entropy_forward", "loss"),
    ("liger_cross_entropy_kernel", "loss"),
    ("_cce_backward_kernel", "loss"),
    ("void barqtrain::kernels::(anonymous namespace)::cross_entropy_rows_kernel<__nv_bfloat16, 8>"
     "(barqtrain::kernels::CrossEntropyRowsParams)", "loss"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, c10::BFloat16 const*, int)", "loss"),
    ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>"
     "(float*, float*, float const*, long const*, float const*, bool, long, long, long, long)", "loss"),
    # copies and casts
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_"
     "kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#12}::operator()() const::"
     "{lambda(c10::BFloat16)#1}>(at::TensorIteratorBase&, at::native::direct_copy_kernel_cuda(at::TensorIterator"
     "Base&)::{lambda()#3}::operator()() const::{lambda()#12}::operator()() const::{lambda(c10::BFloat16)#1} "
     "const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<...>::{lambda(int)#1})", "copy_cast"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda(at::TensorIterator"
     "Base&)::{lambda(float)#1}, std::array<char*, 2ul> >(int, at::native::bfloat16_copy_kernel_cuda(at::Tensor"
     "IteratorBase&)::{lambda(float)#1}, std::array<char*, 2ul>)", "copy_cast"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType"
     "<2u>, unsigned int, 4, 64, 64>(at::native::(anonymous namespace)::OpaqueType<2u>*, at::native::(anonymous "
     "namespace)::CatArrInputTensorMetadata<at::native::(anonymous namespace)::OpaqueType<2u>, unsigned int, 64, "
     "64>, at::native::(anonymous namespace)::TensorSizeStride<unsigned int, 4u>, int, unsigned int)", "copy_cast"),
    ("Memcpy DtoD (Device -> Device)", "copy_cast"),
    ("Memset (Device)", "copy_cast"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
     "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)", "copy_cast"),
    # the optimizer
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::Tensor"
     "ListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, "
     "false>, float*, double, float*, float*, double, double, double, double, bool, float*, float*>(at::native::"
     "(anonymous namespace)::TensorListMetadata<4>, ...)", "optimizer"),
    # the rest
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<"
     "char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)", "elementwise_other"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4, 4>)", "elementwise_other"),
    ("triton_poi_fused_add_mul_0", "elementwise_other"),
    # torch.compile's fused kernels (Unsloth compiles its decoder layers)
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm_act_rope"),
    ("triton_poi_fused__to_copy_mul_silu_2", "norm_act_rope"),
    ("triton_poi_fused__to_copy_1", "copy_cast"),
    ("triton_tem_fused_addmm_3", "gemm"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
     "true>(...)", "elementwise_other"),
    ("some_unknown_kernel", "other"),
    # CPU operators (the --tiny run)
    ("aten::mm", "gemm"),
    ("aten::addmm_", "gemm"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::_log_softmax", "loss"),
    ("aten::silu", "norm_act_rope"),
    ("aten::copy_", "copy_cast"),
    ("aten::_to_copy", "copy_cast"),
    ("Optimizer.step#AdamW.step", "optimizer"),
    ("aten::add_", "elementwise_other"),
    ("ProfilerStep*", "other"),
]  # fmt: skip


@pytest.mark.parametrize("name, category", KERNEL_NAMES, ids=[name[:60] for name, _ in KERNEL_NAMES])
def test_each_kernel_lands_in_its_category(name, category):
    assert classify_kernel(name) == category


def test_every_category_is_exercised():
    assert {category for _, category in KERNEL_NAMES} == set(CATEGORIES)


def test_the_summary_counts_idle_time_outside_the_union_of_kernels():
    kernels = [
        KernelTime("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 0.0, 600.0, 600.0),
        # on a second stream, overlapping the GEMM: busy once, but counted in its category
        KernelTime("Memcpy DtoD (Device -> Device)", 500.0, 700.0, 200.0),
        KernelTime("_rms_layernorm_forward", 1000.0, 1100.0, 100.0),
        KernelTime("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 1500.0, 2100.0, 600.0),
    ]
    summary = summarize_kernels(kernels, wall_us=4000.0, steps=2)
    assert summary["step_ms"] == pytest.approx(2.0)
    assert summary["categories_ms"]["gemm"] == pytest.approx(0.6)
    assert summary["categories_ms"]["copy_cast"] == pytest.approx(0.1)
    assert summary["categories_ms"]["norm_act_rope"] == pytest.approx(0.05)
    assert summary["categories_ms"]["other"] == 0.0
    # busy: [0, 700] + [1000, 1100] + [1500, 2100] = 1400 µs of 4000, over 2 steps
    assert summary["gpu_idle_ms"] == pytest.approx(1.3)
    assert summary["launches"] == 2.0
    assert [kernel["category"] for kernel in summary["top_kernels"]] == ["gemm", "copy_cast", "norm_act_rope"]
    assert summary["top_kernels"][0]["ms"] == pytest.approx(0.6) and summary["top_kernels"][0]["calls"] == 1.0


def test_the_table_gives_milliseconds_and_shares_of_the_step():
    summary = summarize_kernels([KernelTime("aten::mm", 0.0, 3000.0, 3000.0)], wall_us=4000.0, steps=1)
    table = profile_table(
        [{"model": "m", "variant": "v", "profile": summary}, {"model": "m", "variant": "failed", "status": "error"}]
    )
    header, _, row = table.splitlines()
    assert header.split()[:4] == ["model", "variant", "step", "ms"] and "idle" in header
    assert row.split()[:3] == ["m", "v", "4.0"]
    assert "3.0 (75%)" in row and "1.0 (25%)" in row  # gemm, idle


def test_profiling_a_cpu_loop_adds_up_to_the_step():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 16))
    optimizer = torch.optim.AdamW(model.parameters())
    batches = [torch.randn(8, 16) for _ in range(PROFILER_WARMUP_STEPS + PROFILED_STEPS)]

    def step(inputs):
        loss = model(inputs).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    profile = profile_steps(step, batches, torch.device("cpu"))
    assert profile["activity"] == "cpu" and profile["profiled_steps"] == PROFILED_STEPS
    assert profile["categories_ms"]["gemm"] > 0 and profile["launches"] > 0
    total = sum(profile["categories_ms"].values()) + profile["gpu_idle_ms"]
    assert total == pytest.approx(profile["step_ms"], rel=0.1)
    with pytest.raises(ValueError, match=f"expected {PROFILER_WARMUP_STEPS + PROFILED_STEPS} batches, got 1"):
        profile_steps(step, batches[:1], torch.device("cpu"))
