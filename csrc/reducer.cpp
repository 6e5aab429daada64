// The gradient reducer's hot path (torchstrategy._C.Reducer): bucket layout and
// bookkeeping, the autograd hooks, launching each full bucket's all-reduce, and settling
// the gradients after backward. torchstrategy/collectives/reducer.py documents the
// semantics; this file implements them without a Python call per parameter:
//
// - a C++ tensor pre-hook on each parameter (before autograd accumulates into .grad)
//   keeps aside a .grad that holds an earlier sum, except a zeroed bucket view;
// - a C++ post-hook on each parameter's AccumulateGrad node marks it ready; a bucket
//   whose parameters are all ready is launched (bucket order kept), copying only the
//   gradients that are not already views into the bucket;
// - a callback queued on the autograd engine calls back into Python once per backward
//   (so that collective failures are explained there); it calls finalize().
//
// The all-reduce goes through the c10d ProcessGroup directly for the default
// NcclAllReduce(num_packs=1), or through any Python CrossDeviceOps' all_reduce_async.
#include <torch/extension.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <ATen/core/dispatch/Dispatcher.h>

#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace torchstrategy {
namespace {

namespace py = pybind11;
using torch::autograd::variable_list;

constexpr int64_t kAlignmentBytes = 16;

// `elements` rounded up so that the next slot starts on a 16-byte boundary.
int64_t aligned(int64_t elements, int64_t element_size) {
  const int64_t step = std::max<int64_t>(1, kAlignmentBytes / element_size);
  return (elements + step - 1) / step * step;
}

// True when every byte is zero (a bucket view after zero_grad(set_to_none=False)).
bool all_zero_bytes(const at::Tensor& t) {
  const auto* p = static_cast<const unsigned char*>(t.const_data_ptr());
  const size_t n = static_cast<size_t>(t.numel()) * t.element_size();
  size_t k = 0;
  for (; k + 8 <= n; k += 8) {
    uint64_t word;
    std::memcpy(&word, p + k, 8);
    if (word != 0) return false;
  }
  for (; k < n; ++k) {
    if (p[k] != 0) return false;
  }
  return true;
}

// Runs torch.ops.torchstrategy.pack / unpack (the device's fused kernel) on one buffer.
void cast_copy(const at::Tensor& src, const at::Tensor& dst, double scale, bool pack) {
  static const c10::OperatorHandle pack_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("torchstrategy::pack", "");
  static const c10::OperatorHandle unpack_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("torchstrategy::unpack", "");
  std::vector<c10::IValue> stack;
  if (pack) {  // dst is the flat buffer
    c10::List<std::optional<at::Tensor>> sources;
    sources.push_back(src);
    stack = {dst, sources, std::vector<int64_t>{0}, std::vector<int64_t>{src.numel()}, scale};
    pack_op.callBoxed(&stack);
  } else {     // src is the flat buffer
    stack = {src, std::vector<at::Tensor>{dst}, std::vector<int64_t>{0}, scale, false};
    unpack_op.callBoxed(&stack);
  }
}

struct Bucket {
  std::vector<int64_t> params;  // parameter indices, in slot order
  std::vector<int64_t> offsets;
  std::vector<int64_t> numels;
  int64_t size = 0;             // elements up to the end of the last slot
  int64_t flags_at = 0;         // one "contributed" flag per parameter from here
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  at::Tensor flat;
  std::vector<at::Tensor> views;
  at::Tensor wire;              // the compressed copy on the wire; undefined: flat travels
  std::vector<char> ready;
  int64_t pending = 0;
  bool complete = false;        // launched with every parameter ready
  c10::intrusive_ptr<c10d::Work> work;
  std::optional<py::object> py_work;  // set and cleared with the GIL held
};

}  // namespace

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  Reducer(int64_t cap_bytes, int64_t first_cap_bytes, int64_t world_size,
          std::string compression, py::object process_group, py::object cross_device_ops,
          py::object group, py::object hold, py::object finalize_callback)
      : cap_(cap_bytes), first_cap_(std::min(first_cap_bytes, cap_bytes)),
        world_size_(world_size), cross_device_ops_(std::move(cross_device_ops)),
        group_(std::move(group)), hold_(std::move(hold)),
        finalize_callback_(std::move(finalize_callback)) {
    if (compression == "bf16") {
      wire_dtype_ = at::kBFloat16;
    } else if (compression == "fp16") {
      wire_dtype_ = at::kHalf;
    } else {
      TORCH_CHECK(compression.empty(), "torchstrategy: unknown compression ", compression);
    }
    if (!process_group.is_none()) {
      process_group_ = process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
    }
  }

  // Registers parameters (hooks included); build() must follow.
  void add_parameters(const std::vector<at::Tensor>& params) {
    std::weak_ptr<Reducer> weak = weak_from_this();
    for (const at::Tensor& p : params) {
      const int64_t index = static_cast<int64_t>(params_.size());
      params_.push_back(p);
      p.register_hook([weak, index](const at::Tensor&) {
        if (auto self = weak.lock()) self->before_accumulation(index);
      });
      c10::intrusive_ptr<torch::autograd::Node> accumulator =
          torch::autograd::impl::grad_accumulator(p);
      TORCH_CHECK(accumulator, "torchstrategy: parameter ", index, " is not a leaf");
      accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [weak, index](const variable_list& outputs, const variable_list&) {
            if (auto self = weak.lock()) self->on_ready(index);
            return outputs;
          }));
      accumulators_.push_back(std::move(accumulator));
    }
    local_.assign(params_.size(), 0);
    stash_.resize(params_.size());
    synced_part_.resize(params_.size());
  }

  // Lays out the parameters, in `order`, into buckets: one dtype and device per bucket,
  // the first capped at first_cap bytes, the others at cap. Gradients that were views into
  // the old buckets move into the new ones.
  void build(const std::vector<int64_t>& order) {
    std::lock_guard<std::mutex> lock(mutex_);
    at::NoGradGuard no_grad;
    TORCH_CHECK(order.size() == params_.size(), "torchstrategy: bucket order has ",
                order.size(), " parameters, expected ", params_.size());
    std::vector<int64_t> moving;
    if (!slots_.empty()) {
      for (int64_t i : order) {
        if (is_view(i, params_[i].grad())) moving.push_back(i);
      }
    }
    std::vector<Bucket> buckets;
    std::map<std::pair<int, std::string>, size_t> open;
    for (int64_t i : order) {
      const at::Tensor& p = params_[i];
      const int64_t size = p.element_size();
      const auto key = std::make_pair(static_cast<int>(p.scalar_type()), p.device().str());
      auto found = open.find(key);
      if (found != open.end()) {
        const Bucket& b = buckets[found->second];
        const int64_t cap = found->second == 0 ? first_cap_ : cap_;
        if ((aligned(b.size, size) + p.numel()) * size > cap) open.erase(found);
      }
      found = open.find(key);
      if (found == open.end()) {
        Bucket b;
        b.dtype = p.scalar_type();
        b.device = p.device();
        buckets.push_back(std::move(b));
        found = open.emplace(key, buckets.size() - 1).first;
      }
      Bucket& b = buckets[found->second];
      const int64_t offset = aligned(b.size, size);
      b.params.push_back(i);
      b.offsets.push_back(offset);
      b.numels.push_back(p.numel());
      b.size = offset + p.numel();
    }
    std::vector<std::pair<int64_t, int64_t>> slots(params_.size());
    for (size_t bi = 0; bi < buckets.size(); ++bi) {
      Bucket& b = buckets[bi];
      const auto options = at::TensorOptions().dtype(b.dtype).device(b.device);
      const int64_t size = at::elementSize(b.dtype);
      b.flags_at = aligned(b.size, size);
      // Padding stays zero forever.
      b.flat = at::zeros({b.flags_at + static_cast<int64_t>(b.params.size())}, options);
      for (size_t k = 0; k < b.params.size(); ++k) {
        b.views.push_back(b.flat.narrow(0, b.offsets[k], b.numels[k])
                              .view(params_[b.params[k]].sizes()));
        slots[b.params[k]] = {static_cast<int64_t>(bi), static_cast<int64_t>(k)};
      }
      if (wire_dtype_ && at::isFloatingType(b.dtype) &&
          size > at::elementSize(*wire_dtype_)) {
        b.wire = at::empty({b.flat.numel()}, options.dtype(*wire_dtype_));
      }
      b.ready.assign(b.params.size(), 0);
      b.pending = static_cast<int64_t>(b.params.size());
    }
    for (int64_t i : moving) {
      const auto [bi, k] = slots[i];
      buckets[bi].views[k].copy_(params_[i].grad());
      params_[i].mutable_grad() = buckets[bi].views[k];
    }
    buckets_ = std::move(buckets);
    slots_ = std::move(slots);
    next_launch_ = 0;
  }

  void set_sync(bool sync) { sync_ = sync; }
  bool sync() const { return sync_; }

  // Starts recording the order gradients arrive in (the next synchronised backward).
  void start_recording() {
    recording_ = true;
    arrival_.clear();
  }

  // The recorded arrival order (parameter indices), once a synchronised backward ran.
  std::optional<std::vector<int64_t>> take_arrival() {
    if (!recording_ || !recorded_) return std::nullopt;
    recording_ = false;
    recorded_ = false;
    return std::move(arrival_);
  }

  // What the post-accumulate-grad hook does, outside backward (benchmarks, tests): marks
  // parameter `index` ready, launching its bucket once full. finalize() must follow.
  void mark_ready(int64_t index) {
    queued_ = true;  // no backward to queue the finalisation on: the caller runs it
    on_ready(index);
  }

  // Called from Python (GIL held) once per backward by the queued callback: launches the
  // buckets still waiting, waits for every all-reduce and settles the gradients. Returns
  // whether this backward was synchronised (produced any gradient).
  bool finalize() {
    at::NoGradGuard no_grad;
    const bool synced = any_ready_;
    if (synced) {
      {
        // Never enqueue holding the GIL: a gloo worker thread releasing a finished work
        // takes the GIL while holding the queue's lock.
        py::gil_scoped_release no_gil;
        for (size_t b = next_launch_; b < buckets_.size(); ++b) launch(buckets_[b]);
      }
      next_launch_ = buckets_.size();
      double waited = 0.0;
      for (Bucket& b : buckets_) {
        const auto start = std::chrono::steady_clock::now();
        if (b.work) {
          py::gil_scoped_release no_gil;
          b.work->wait();
        } else if (b.py_work) {
          b.py_work->attr("wait")();
        }
        waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                      .count();
        b.work.reset();
        b.py_work.reset();
        if (b.wire.defined()) cast_copy(b.wire, b.flat, static_cast<double>(world_size_), false);
        settle(b);
      }
      std::fill(local_.begin(), local_.end(), 0);
      ++steps_;
      last_bytes_ = step_bytes_;
      last_buckets_ = step_buckets_;
      last_waited_ = waited;
      if (recording_) recorded_ = true;
    }
    // Gradients set aside for a backward that accumulated nothing (autograd.grad).
    for (size_t i = 0; i < stash_.size(); ++i) {
      if (!stash_[i].defined()) continue;
      at::Tensor& grad = params_[i].mutable_grad();
      grad = grad.defined() ? grad + stash_[i] : stash_[i];
      stash_[i] = at::Tensor();
    }
    return synced;
  }

  // Clears the per-backward state (GIL held; also after a failed finalize).
  void reset_step() {
    for (at::Tensor& t : stash_) t = at::Tensor();
    queued_ = false;
    any_ready_ = false;
    next_launch_ = 0;
    step_bytes_ = 0;
    step_buckets_ = 0;
    for (Bucket& b : buckets_) {
      std::fill(b.ready.begin(), b.ready.end(), 0);
      b.pending = static_cast<int64_t>(b.params.size());
      b.complete = false;
      b.work.reset();
      b.py_work.reset();
    }
  }

  // -- inspection ----------------------------------------------------------------------
  std::vector<int64_t> bucket_sizes() const {
    std::vector<int64_t> out;
    for (const Bucket& b : buckets_) out.push_back(static_cast<int64_t>(b.params.size()));
    return out;
  }

  std::vector<int64_t> bucket_order() const {
    std::vector<int64_t> out;
    for (const Bucket& b : buckets_) out.insert(out.end(), b.params.begin(), b.params.end());
    return out;
  }

  // (dtype name, slot sizes, elements of the flat buffer, wire dtype name or "") per bucket.
  std::vector<std::tuple<std::string, std::vector<int64_t>, int64_t, std::string>>
  bucket_layout() const {
    std::vector<std::tuple<std::string, std::vector<int64_t>, int64_t, std::string>> out;
    for (const Bucket& b : buckets_) {
      out.emplace_back(c10::toString(b.dtype), b.numels, b.flat.numel(),
                       b.wire.defined() ? c10::toString(b.wire.scalar_type()) : "");
    }
    return out;
  }

  // True when buckets are launched on the c10d process group from C++; false when they go
  // through the cross-device ops' Python all_reduce_async.
  bool launches_on_process_group() const { return static_cast<bool>(process_group_); }

  bool is_bucket_view(int64_t index) const { return is_view(index, params_[index].grad()); }

  // (bytes reduced, buckets launched, seconds waited, synchronised backward passes).
  std::tuple<int64_t, int64_t, double, int64_t> stats() const {
    return {last_bytes_, last_buckets_, last_waited_, steps_};
  }

 private:
  bool is_view(int64_t index, const at::Tensor& grad) const {
    if (!grad.defined() || slots_.empty()) return false;
    const auto [bi, k] = slots_[index];
    const at::Tensor& view = buckets_[bi].views[k];
    return grad.data_ptr() == view.data_ptr() && grad.sizes() == view.sizes() &&
           grad.strides() == view.strides() && grad.scalar_type() == view.scalar_type() &&
           grad.device() == view.device() && !grad.is_sparse();
  }

  // Tensor pre-hook: runs before autograd adds this backward's gradient to .grad.
  void before_accumulation(int64_t index) {
    std::lock_guard<std::mutex> lock(mutex_);
    at::NoGradGuard no_grad;
    at::Tensor& grad = params_[index].mutable_grad();
    if (!grad.defined() || local_[index]) return;
    const bool view = is_view(index, grad);
    // A zeroed view (zero_grad(set_to_none=False)): accumulate into the bucket directly.
    // Checked on CPU only: on a GPU the check would synchronise the stream.
    if (view && grad.device().is_cpu() && all_zero_bytes(grad)) return;
    if (sync_) {
      // An earlier sum: keep it aside (a copy, if the view's memory is about to be
      // reused) so that only the new gradient is summed; it is added back afterwards.
      stash_[index] = view ? grad.clone() : grad;
      grad = at::Tensor();
      queue_finalize();
    } else {
      // A no_sync backward accumulates onto an already-summed gradient: remember that
      // part, so the next synchronised backward sums only what accumulated locally.
      synced_part_[index] = grad.detach().clone();
    }
  }

  // AccumulateGrad post-hook: .grad holds this backward's gradient.
  void on_ready(int64_t index) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!sync_) {
      local_[index] = 1;
      return;
    }
    queue_finalize();
    any_ready_ = true;
    if (recording_) arrival_.push_back(index);
    const auto [bi, k] = slots_[index];
    Bucket& b = buckets_[bi];
    TORCH_CHECK(!b.ready[k],
                "A parameter received its gradient twice in one backward pass (reentrant "
                "activation checkpointing?). Use torch.utils.checkpoint with "
                "use_reentrant=False under a torchstrategy strategy.");
    b.ready[k] = 1;
    if (--b.pending == 0) {
      // Strictly in bucket order, so every replica issues the same collectives.
      while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
        launch(buckets_[next_launch_]);
        ++next_launch_;
      }
    }
  }

  void queue_finalize() {
    if (queued_) return;
    queued_ = true;
    std::weak_ptr<Reducer> weak = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto self = weak.lock()) {
        py::gil_scoped_acquire gil;
        self->finalize_callback_();
      }
    });
  }

  // Puts this replica's contribution into the bucket and starts its all-reduce.
  void launch(Bucket& b) {
    at::NoGradGuard no_grad;
    b.complete = b.pending == 0;
    const size_t count = b.params.size();
    std::vector<float> flags(count, 1.0f);
    for (size_t k = 0; k < count; ++k) {
      const int64_t i = b.params[k];
      at::Tensor& grad = params_[i].mutable_grad();
      at::Tensor contribution;
      if (b.ready[k] || (local_[i] && grad.defined())) {
        contribution = grad;  // this backward's, or accumulated under no_sync
      } else if (is_view(i, grad)) {
        // An older sum living in the slot that is about to carry zeros: keep it.
        stash_[i] = grad.clone();
        grad = at::Tensor();
      }
      at::Tensor& view = b.views[k];
      if (!contribution.defined()) {
        view.zero_();
        flags[k] = 0.0f;
        continue;
      }
      TORCH_CHECK(!contribution.is_sparse(),
                  "Sparse gradients (nn.Embedding(sparse=True)) are not supported by the "
                  "gradient reducer; use dense gradients.");
      if (!is_view(i, contribution)) {
        view.copy_(contribution);
        grad = view;
      }
      if (synced_part_[i].defined()) view.sub_(synced_part_[i]);
    }
    at::Tensor flag_slots = b.flat.narrow(0, b.flags_at, static_cast<int64_t>(count));
    if (b.complete) {
      flag_slots.fill_(1);
    } else {
      flag_slots.copy_(at::tensor(flags));
    }
    at::Tensor wire = b.flat;
    if (b.wire.defined()) {
      // Each replica's values scaled by 1/N so that the sum stays in the wire's range.
      cast_copy(b.flat, b.wire, 1.0 / static_cast<double>(world_size_), true);
      wire = b.wire;
    }
    step_bytes_ += wire.numel() * wire.element_size();
    ++step_buckets_;
    if (process_group_) {
      std::vector<at::Tensor> tensors{wire};
      b.work = process_group_->allreduce(tensors);
    } else {
      py::gil_scoped_acquire gil;
      // A fresh alias for Python: the backend may drop its reference after ours.
      py::object alias = py::cast(wire.alias());
      hold_(alias);
      b.py_work = cross_device_ops_.attr("all_reduce_async")(alias, group_);
    }
  }

  // After the all-reduce: every gradient some replica contributed becomes its view (which
  // now holds the sum), plus what was set aside before backward.
  void settle(Bucket& b) {
    const size_t count = b.params.size();
    if (b.complete) {
      for (size_t k = 0; k < count; ++k) {
        at::Tensor kept = take_kept(b.params[k]);
        if (kept.defined()) b.views[k].add_(kept);
      }
      return;
    }
    at::Tensor flags = b.flat.narrow(0, b.flags_at, static_cast<int64_t>(count))
                           .to(at::kCPU, at::kDouble);
    const double* contributed = flags.const_data_ptr<double>();
    for (size_t k = 0; k < count; ++k) {
      const int64_t i = b.params[k];
      at::Tensor kept = take_kept(i);
      at::Tensor& grad = params_[i].mutable_grad();
      if (contributed[k] <= 0) {
        if (kept.defined()) grad = kept;  // no replica produced a gradient: as it was
        continue;
      }
      at::Tensor& view = b.views[k];
      if (grad.defined() && !is_view(i, grad)) view.add_(grad);  // an older sum + new sum
      grad = view;
      if (kept.defined()) view.add_(kept);
    }
  }

  at::Tensor take_kept(int64_t index) {
    at::Tensor kept;
    if (stash_[index].defined()) {
      std::swap(kept, stash_[index]);
    } else if (synced_part_[index].defined()) {
      std::swap(kept, synced_part_[index]);
    }
    return kept;
  }

  const int64_t cap_;
  const int64_t first_cap_;
  const int64_t world_size_;
  std::optional<at::ScalarType> wire_dtype_;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  py::object cross_device_ops_;
  py::object group_;
  py::object hold_;
  py::object finalize_callback_;

  std::mutex mutex_;
  std::vector<at::Tensor> params_;
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> accumulators_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<int64_t, int64_t>> slots_;  // parameter -> (bucket, slot)
  std::vector<char> local_;            // accumulated under no_sync since the last sync
  std::vector<at::Tensor> stash_;      // .grad kept from before this backward
  std::vector<at::Tensor> synced_part_;  // summed part under a no_sync accumulation
  bool sync_ = true;
  bool queued_ = false;
  bool any_ready_ = false;
  size_t next_launch_ = 0;
  bool recording_ = false;
  bool recorded_ = false;
  std::vector<int64_t> arrival_;
  int64_t step_bytes_ = 0;
  int64_t step_buckets_ = 0;
  int64_t last_bytes_ = 0;
  int64_t last_buckets_ = 0;
  double last_waited_ = 0.0;
  int64_t steps_ = 0;
};

void bind_reducer(py::module_& m) {
  py::class_<Reducer, std::shared_ptr<Reducer>>(m, "Reducer")
      .def(py::init<int64_t, int64_t, int64_t, std::string, py::object, py::object,
                    py::object, py::object, py::object>(),
           py::arg("cap_bytes"), py::arg("first_cap_bytes"), py::arg("world_size"),
           py::arg("compression"), py::arg("process_group"), py::arg("cross_device_ops"),
           py::arg("group"), py::arg("hold"), py::arg("finalize_callback"))
      .def("add_parameters", &Reducer::add_parameters)
      .def("build", &Reducer::build)
      .def("set_sync", &Reducer::set_sync)
      .def("sync", &Reducer::sync)
      .def("start_recording", &Reducer::start_recording)
      .def("take_arrival", &Reducer::take_arrival)
      .def("mark_ready", &Reducer::mark_ready, py::call_guard<py::gil_scoped_release>())
      .def("finalize", &Reducer::finalize)
      .def("reset_step", &Reducer::reset_step)
      .def("bucket_sizes", &Reducer::bucket_sizes)
      .def("bucket_order", &Reducer::bucket_order)
      .def("bucket_layout", &Reducer::bucket_layout)
      .def("is_bucket_view", &Reducer::is_bucket_view)
      .def("launches_on_process_group", &Reducer::launches_on_process_group)
      .def("stats", &Reducer::stats);
}

}  // namespace torchstrategy

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torchstrategy's fused kernels (registered as torch.ops.torchstrategy.*) and "
            "the gradient reducer's hot path (Reducer)";
  torchstrategy::bind_reducer(m);
}
