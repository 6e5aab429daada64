// Every registration of torchstrategy._C, in one place: the torch ops
// (torch.ops.torchstrategy.*) with their kernel per device, and the Python module (the
// Reducer and the bucket layout policy). The other files in csrc/ only implement.
#include "bucket_layout.h"
#include "bucket_ops.h"
#include "ef_ops.h"
#include "powersgd_ops.h"
#include "reducer.h"

#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

namespace py = pybind11;

TORCH_LIBRARY(torchstrategy, m) {
  m.def("pack(Tensor(a!) flat, Tensor?[] tensors, int[] offsets, int[] numels, "
        "float scale) -> ()");
  m.def("unpack(Tensor flat, Tensor(a!)[] tensors, int[] offsets, float scale, "
        "bool accumulate) -> ()");
  m.def("pack_reference(Tensor(a!) flat, Tensor?[] tensors, int[] offsets, int[] numels, "
        "float scale) -> ()");
  m.def("unpack_reference(Tensor flat, Tensor(a!)[] tensors, int[] offsets, float scale, "
        "bool accumulate) -> ()");
  m.def("ef_quantize_int8(Tensor grad, Tensor(a!) residual, Tensor(b!) q, Tensor(c!) scales, "
        "int chunk) -> ()");
  m.def("dequantize_sum(Tensor q, Tensor scales, Tensor(a!) out, int chunk) -> ()");
  m.def("ef_quantize_int8_reference(Tensor grad, Tensor(a!) residual, Tensor(b!) q, "
        "Tensor(c!) scales, int chunk) -> ()");
  m.def("dequantize_sum_reference(Tensor q, Tensor scales, Tensor(a!) out, int chunk) -> ()");
  m.def("powersgd_finish(Tensor(a!) residual, Tensor p, Tensor q_local_t, Tensor q_t, "
        "Tensor(b!) out) -> ()");
  m.def("powersgd_finish_reference(Tensor(a!) residual, Tensor p, Tensor q_local_t, "
        "Tensor q_t, Tensor(b!) out) -> ()");
  m.def("powersgd_finish_batched(Tensor(a!) residual, Tensor p, Tensor q_local_t, "
        "Tensor q_t, Tensor(b!) out) -> ()");
  m.def("powersgd_project(Tensor(a!) residual, Tensor grad, Tensor q_t, Tensor(b!) p) -> ()");
  m.def("powersgd_project_reference(Tensor(a!) residual, Tensor grad, Tensor q_t, "
        "Tensor(b!) p) -> ()");
}

// Every device without a dedicated kernel gets the generic implementation.
TORCH_LIBRARY_IMPL(torchstrategy, CompositeExplicitAutograd, m) {
  m.impl("pack", &torchstrategy::pack_generic);
  m.impl("unpack", &torchstrategy::unpack_generic);
  m.impl("pack_reference", &torchstrategy::pack_generic);
  m.impl("unpack_reference", &torchstrategy::unpack_generic);
  m.impl("ef_quantize_int8", &torchstrategy::ef_quantize_int8_generic);
  m.impl("dequantize_sum", &torchstrategy::dequantize_sum_generic);
  m.impl("ef_quantize_int8_reference", &torchstrategy::ef_quantize_int8_generic);
  m.impl("dequantize_sum_reference", &torchstrategy::dequantize_sum_generic);
  m.impl("powersgd_finish", &torchstrategy::powersgd_finish_generic);
  m.impl("powersgd_finish_reference", &torchstrategy::powersgd_finish_generic);
  m.impl("powersgd_finish_batched", &torchstrategy::powersgd_finish_batched_generic);
  m.impl("powersgd_project", &torchstrategy::powersgd_project_generic);
  m.impl("powersgd_project_reference", &torchstrategy::powersgd_project_generic);
}

TORCH_LIBRARY_IMPL(torchstrategy, CPU, m) {
  m.impl("pack", &torchstrategy::pack_cpu);
  m.impl("unpack", &torchstrategy::unpack_cpu);
  m.impl("ef_quantize_int8", &torchstrategy::ef_quantize_int8_cpu);
  m.impl("dequantize_sum", &torchstrategy::dequantize_sum_cpu);
  m.impl("powersgd_finish", &torchstrategy::powersgd_finish_cpu);
  m.impl("powersgd_finish_batched", &torchstrategy::powersgd_finish_batched_cpu);
  m.impl("powersgd_project", &torchstrategy::powersgd_project_cpu);
}

#ifdef TORCHSTRATEGY_WITH_CUDA  // set by setup.py when csrc/*.cu is built
TORCH_LIBRARY_IMPL(torchstrategy, CUDA, m) {
  m.impl("pack", &torchstrategy::pack_cuda);
  m.impl("unpack", &torchstrategy::unpack_cuda);
}
#endif

namespace {

void bind_reducer(py::module_& m) {
  using torchstrategy::Reducer;
  py::class_<Reducer, std::shared_ptr<Reducer>>(m, "Reducer")
      .def(py::init<int64_t, int64_t, int64_t, std::string, py::object, py::object,
                    py::object>(),
           py::arg("cap_bytes"), py::arg("first_cap_bytes"), py::arg("world_size"),
           py::arg("compression"), py::arg("process_group"), py::arg("launch_bucket"),
           py::arg("finalize_callback"))
      .def("add_parameters", &Reducer::add_parameters)
      .def("build", &Reducer::build, py::arg("order"), py::arg("whole") = false)
      // build releases the GIL itself (see reducer.h)
      .def("set_sync", &Reducer::set_sync)
      .def("sync", &Reducer::sync)
      .def("start_recording", &Reducer::start_recording)
      .def("take_arrival", &Reducer::take_arrival)
      .def("mark_ready", &Reducer::mark_ready, py::call_guard<py::gil_scoped_release>())
      .def("finalize", &Reducer::finalize)
      .def("reset_step", &Reducer::reset_step)
      .def("set_interrupted", &Reducer::set_interrupted)  // any thread: an atomic flag
      .def("drain", &Reducer::drain, py::arg("seconds"))  // releases the GIL itself
      .def("average_this_backward", &Reducer::average_this_backward)  // releases the GIL
      .def("bucket_sizes", &Reducer::bucket_sizes)
      .def("bucket_order", &Reducer::bucket_order)
      .def("bucket_layout",
           [](const Reducer& self) {
             // Per bucket: (dtype, parameter indices, slot offsets, slot sizes, its first
             // flag in flags(), elements of the flat buffer, wire dtype or "").
             std::vector<std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>,
                                    std::vector<int64_t>, int64_t, int64_t, std::string>>
                 out;
             for (torchstrategy::BucketInfo& b : self.bucket_layout()) {
               out.emplace_back(std::move(b.dtype), std::move(b.params),
                                std::move(b.offsets), std::move(b.numels), b.first_flag,
                                b.elements, std::move(b.wire));
             }
             return out;
           })
      .def("flags", &Reducer::flags)
      .def("bucket_complete", &Reducer::bucket_complete)
      .def("is_bucket_view", &Reducer::is_bucket_view)
      .def("launches_on_process_group", &Reducer::launches_on_process_group)
      .def("stats", &Reducer::stats);
}

void bind_bucket_layout(py::module_& m) {
  m.def(
      "compute_bucket_layout",
      [](const std::vector<int64_t>& order, const std::vector<int64_t>& numels,
         const std::vector<int64_t>& element_sizes, const std::vector<std::string>& keys,
         int64_t first_cap_bytes, int64_t cap_bytes) {
        std::vector<std::tuple<std::vector<int64_t>, std::vector<int64_t>, int64_t>> out;
        for (torchstrategy::BucketSpec& b : torchstrategy::compute_bucket_layout(
                 order, numels, element_sizes, keys, first_cap_bytes, cap_bytes)) {
          out.emplace_back(std::move(b.params), std::move(b.offsets), b.elements);
        }
        return out;
      },
      py::arg("order"), py::arg("numels"), py::arg("element_sizes"), py::arg("keys"),
      py::arg("first_cap_bytes"), py::arg("cap_bytes"),
      "The reducer's bucket layout (csrc/bucket_layout.h): per bucket, in launch order, "
      "(parameter indices, slot offsets in elements, elements up to the end of the last "
      "slot).");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torchstrategy's fused kernels (registered as torch.ops.torchstrategy.*), "
            "the gradient reducer's hot path (Reducer) and its bucket layout policy";
  bind_reducer(m);
  bind_bucket_layout(m);
}
