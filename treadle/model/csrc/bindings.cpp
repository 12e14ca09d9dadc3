// The one Python module of the native kernels (each source defines its entry points; this file
// only names them).
#include "kernels.h"

#include <torch/csrc/utils/pybind.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("rope", &rope);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("prefill_attention", &prefill_attention);
  m.def("prefill_attention_available", &prefill_attention_available);
  m.def("quant_linear", &quant_linear);
  m.def("quant_linear_parts", &quant_linear_parts);
  m.def("quant_gemm_parts", &quant_gemm_parts);
  m.def("quant_gemm_types", &quant_gemm_types);
  m.def("quant_gemm_same_bits_types", &quant_gemm_same_bits_types);
  m.def("dequantize", &dequantize);
  m.def("dequantize_bf16", &dequantize_bf16);
  m.def("sample_rows", &sample_rows);
  m.def("lora_add", &lora_add);
  pybind11::class_<LlamaDecoder>(m, "LlamaDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &LlamaDecoder::add_layer)
      .def("set_lora", &LlamaDecoder::set_lora)
      .def("forward", &LlamaDecoder::forward);
  pybind11::class_<QuantMoE>(m, "QuantMoE")
      .def(pybind11::init<std::vector<std::vector<at::Tensor>>, std::vector<std::vector<int64_t>>,
                          std::vector<at::Tensor>, std::vector<int64_t>>())
      .def("forward", &QuantMoE::forward);
}
