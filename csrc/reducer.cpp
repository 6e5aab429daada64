// The Reducer (csrc/reducer.h, which also states the lock order every method follows).
// It works without a Python call per parameter:
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
#include "reducer.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace torchstrategy {
namespace {

namespace py = pybind11;

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

// Parameters share a bucket only when their dtype and device are the same.
std::string layout_key(const at::Tensor& p) {
  return std::string(c10::toString(p.scalar_type())) + "/" + p.device().str();
}

}  // namespace

Reducer::Reducer(int64_t cap_bytes, int64_t first_cap_bytes, int64_t world_size,
                 std::string compression, py::object process_group,
                 py::object launch_bucket, py::object finalize_callback)
    : cap_(cap_bytes), first_cap_(first_cap_bytes), world_size_(world_size),
      launch_bucket_(std::move(launch_bucket)),
      finalize_callback_(std::move(finalize_callback)) {
  if (compression == "bf16") {
    wire_dtype_ = at::kBFloat16;
  } else if (compression == "fp16") {
    wire_dtype_ = at::kHalf;
  } else {
    TORCH_CHECK(compression.empty(), "torchstrategy: unknown compression ", compression);
  }
  if (!process_group.is_none()) {
    process_group_ = compat::process_group_from_python(process_group);
    interruptible_ = compat::is_gloo(*process_group_);
  }
  // DDP multiplies a copied gradient by this wrapped double, so the product is computed
  // in the gradient's dtype exactly as DDP's reducer computes it.
  inverse_world_ = at::scalar_tensor(1.0 / static_cast<double>(world_size_), at::kDouble);
  inverse_world_.unsafeGetTensorImpl()->set_wrapped_number(true);
}

Reducer::~Reducer() {
  // The last reference may be a hook's, on an engine thread without the GIL.
  py::gil_scoped_acquire gil;
  for (Bucket& b : buckets_) b.py_work.reset();
  flags_py_work_.reset();
  for (py::object* held : {&launch_bucket_, &finalize_callback_}) {
    *held = py::object();
  }
}

void Reducer::add_parameters(const std::vector<at::Tensor>& params) {
  std::weak_ptr<Reducer> weak = weak_from_this();
  for (const at::Tensor& p : params) {
    const int64_t index = static_cast<int64_t>(params_.size());
    params_.push_back(p);
    p.register_hook([weak, index](const at::Tensor&) {
      if (auto self = weak.lock()) self->before_accumulation(index);
    });
    compat::GradAccumulator accumulator = compat::grad_accumulator(p);
    TORCH_CHECK(accumulator, "torchstrategy: parameter ", index, " is not a leaf");
    compat::add_post_hook(*accumulator, [weak, index] {
      if (auto self = weak.lock()) self->on_ready(index);
    });
    accumulators_.push_back(std::move(accumulator));
  }
  local_.assign(params_.size(), 0);
  stash_.resize(params_.size());
  synced_part_.resize(params_.size());
}

// Gradients that were views into the old buckets move into the new ones.
void Reducer::build(const std::vector<int64_t>& order, bool whole) {
  std::vector<Bucket> replaced;  // destroyed last, with the GIL back: may hold py_work
  py::gil_scoped_release no_gil;
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
  std::vector<int64_t> numels, element_sizes;
  std::vector<std::string> keys;
  for (const at::Tensor& p : params_) {
    numels.push_back(p.numel());
    element_sizes.push_back(p.element_size());
    keys.push_back(layout_key(p));
  }
  std::vector<Bucket> buckets;
  std::vector<std::pair<int64_t, int64_t>> slots(params_.size());
  int64_t flags = 0;
  for (BucketSpec& spec :
       whole ? compute_whole_layout(order, numels, element_sizes, keys)
             : compute_bucket_layout(order, numels, element_sizes, keys, first_cap_, cap_)) {
    buckets.push_back(allocate(std::move(spec)));
    Bucket& b = buckets.back();
    b.first_flag = flags;
    flags += static_cast<int64_t>(b.params.size());
    for (size_t k = 0; k < b.params.size(); ++k) {
      slots[b.params[k]] = {static_cast<int64_t>(buckets.size() - 1), static_cast<int64_t>(k)};
    }
  }
  for (int64_t i : moving) {
    const auto [bi, k] = slots[i];
    buckets[bi].views[k].copy_(params_[i].grad());
    params_[i].mutable_grad() = buckets[bi].views[k];
  }
  // The flags travel on the first bucket's device (a model's parameters share one).
  wait_for_flags(flags_work_);
  wait_for_flags(spare_flags_work_);
  flags_ = at::zeros({flags}, at::TensorOptions().dtype(at::kFloat).device(
                                  buckets.empty() ? at::Device(at::kCPU) : buckets[0].device));
  spare_flags_ = at::zeros_like(flags_);
  replaced = std::exchange(buckets_, std::move(buckets));
  slots_ = std::move(slots);
  next_launch_ = 0;
}

// The flat buffer of one bucket: the slots `spec` laid out, and nothing else.
Bucket Reducer::allocate(BucketSpec spec) const {
  Bucket b;
  const at::Tensor& first = params_[spec.params.front()];
  b.dtype = first.scalar_type();
  b.device = first.device();
  b.params = std::move(spec.params);
  b.offsets = std::move(spec.offsets);
  const auto options = at::TensorOptions().dtype(b.dtype).device(b.device);
  const int64_t size = at::elementSize(b.dtype);
  b.flat = at::zeros({spec.elements}, options);
  for (size_t k = 0; k < b.params.size(); ++k) {
    const at::Tensor& p = params_[b.params[k]];
    b.numels.push_back(p.numel());
    b.views.push_back(b.flat.narrow(0, b.offsets[k], p.numel()).view(p.sizes()));
  }
  if (wire_dtype_ && at::isFloatingType(b.dtype) && size > at::elementSize(*wire_dtype_)) {
    b.wire = at::empty({b.flat.numel()}, options.dtype(*wire_dtype_));
  }
  b.ready.assign(b.params.size(), 0);
  b.pending = static_cast<int64_t>(b.params.size());
  return b;
}

void Reducer::start_recording() {
  recording_ = true;
  arrival_.clear();
}

std::optional<std::vector<int64_t>> Reducer::take_arrival() {
  if (!recording_ || !recorded_) return std::nullopt;
  recording_ = false;
  recorded_ = false;
  return std::move(arrival_);
}

bool Reducer::average_this_backward() {
  py::gil_scoped_release no_gil;  // mutex_ is never taken holding the GIL (reducer.h)
  std::lock_guard<std::mutex> lock(mutex_);
  if (sync_) {
    average_ = true;
    // Finalised (and the mark cleared) even if none of our parameters gets a gradient.
    queue_finalize();
  }
  return true;
}

void Reducer::mark_ready(int64_t index) {
  queued_ = true;  // no backward to queue the finalisation on: the caller runs it
  on_ready(index);
}

bool Reducer::finalize() {
  at::NoGradGuard no_grad;
  const bool synced = any_ready_;
  if (synced) {
    {
      py::gil_scoped_release no_gil;  // never enqueue holding the GIL (reducer.h)
      for (size_t b = next_launch_; b < buckets_.size(); ++b) launch(buckets_[b]);
    }
    next_launch_ = buckets_.size();
    double waited = 0.0;
    // The flags' sum, launched after the last bucket. On the process group it is waited
    // for only when a bucket launched incomplete here settles by it (reducer.h, flags_work_);
    // through `launch_bucket` it is waited for first, as a Python stage whose reduction
    // runs when its handle is waited for (error feedback) reads them summed.
    const auto flags_start = std::chrono::steady_clock::now();
    step_bytes_ += flags_.numel() * flags_.element_size();
    if (process_group_) {
      py::gil_scoped_release no_gil;
      // The earlier step's sum (finished long ago: a forward pass ran since), and flags_'s
      // own when no launch swapped the buffers (no bucket this step).
      wait_for_flags(spare_flags_work_);
      wait_for_flags(flags_work_);
      flags_work_ = compat::allreduce(*process_group_, flags_);
      const bool read_here = std::any_of(buckets_.begin(), buckets_.end(),
                                         [](const Bucket& b) { return !b.complete; });
      if (read_here) wait_for_flags(flags_work_);
    } else {
      flags_py_work_ = launch_bucket_(-1, py::cast(flags_.alias()));
      flags_py_work_->attr("wait")();
      flags_py_work_.reset();
    }
    waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - flags_start)
                  .count();
    for (Bucket& b : buckets_) {
      const auto start = std::chrono::steady_clock::now();
      if (b.work) {
        py::gil_scoped_release no_gil;
        wait_work(*b.work);
      } else if (b.py_work) {
        b.py_work->attr("wait")();
      }
      waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                    .count();
      b.work.reset();
      b.py_work.reset();
      if (b.wire.defined()) {
        cast_copy(b.wire, b.flat, b.averaged ? 1.0 : static_cast<double>(world_size_), false);
      }
      // Launched before this backward asked to average: divided after the sum instead
      // (the same numbers as before it for a power-of-two world size).
      if (average_ && !b.averaged) b.flat.div_(world_size_);
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

void Reducer::reset_step() {
  for (at::Tensor& t : stash_) t = at::Tensor();
  queued_ = false;
  any_ready_ = false;
  average_ = false;
  next_launch_ = 0;
  step_bytes_ = 0;
  step_buckets_ = 0;
  flags_py_work_.reset();
  for (Bucket& b : buckets_) {
    std::fill(b.ready.begin(), b.ready.end(), 0);
    b.pending = static_cast<int64_t>(b.params.size());
    b.complete = false;
    b.averaged = false;
    b.work.reset();
    b.py_work.reset();
  }
}

std::vector<int64_t> Reducer::bucket_sizes() const {
  std::vector<int64_t> out;
  for (const Bucket& b : buckets_) out.push_back(static_cast<int64_t>(b.params.size()));
  return out;
}

std::vector<int64_t> Reducer::bucket_order() const {
  std::vector<int64_t> out;
  for (const Bucket& b : buckets_) out.insert(out.end(), b.params.begin(), b.params.end());
  return out;
}

std::vector<BucketInfo> Reducer::bucket_layout() const {
  std::vector<BucketInfo> out;
  for (const Bucket& b : buckets_) {
    out.push_back({c10::toString(b.dtype), b.params, b.offsets, b.numels, b.first_flag,
                   b.flat.numel(),
                   b.wire.defined() ? c10::toString(b.wire.scalar_type()) : ""});
  }
  return out;
}

bool Reducer::is_view(int64_t index, const at::Tensor& grad) const {
  if (!grad.defined() || slots_.empty()) return false;
  const auto [bi, k] = slots_[index];
  const at::Tensor& view = buckets_[bi].views[k];
  return grad.data_ptr() == view.data_ptr() && grad.sizes() == view.sizes() &&
         grad.strides() == view.strides() && grad.scalar_type() == view.scalar_type() &&
         grad.device() == view.device() && !grad.is_sparse();
}

// Tensor pre-hook: runs before autograd adds this backward's gradient to .grad.
void Reducer::before_accumulation(int64_t index) {
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
void Reducer::on_ready(int64_t index) {
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

void Reducer::queue_finalize() {
  if (queued_) return;
  queued_ = true;
  std::weak_ptr<Reducer> weak = weak_from_this();
  compat::queue_backward_callback([weak] {
    if (auto self = weak.lock()) {
      py::gil_scoped_acquire gil;
      self->finalize_callback_();
    }
  });
}

// Puts this replica's contribution into the bucket and starts its all-reduce.
void Reducer::launch(Bucket& b) {
  at::NoGradGuard no_grad;
  b.complete = b.pending == 0;
  b.averaged = average_;
  const bool divide_on_wire = b.averaged && b.wire.defined();
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
    // Averaging divides each gradient as DDP's reducer does: while copying it into the
    // bucket (times 1/N), or in place where it already lives there (divided by N). A
    // bucket that travels narrowed is divided by the narrowing instead (its 1/N scale,
    // below), which saves a pass over the bucket.
    bool divided = divide_on_wire;
    if (!is_view(i, contribution)) {
      if (b.averaged && !divided && !synced_part_[i].defined()) {
        at::mul_out(view, contribution, inverse_world_);
        divided = true;
      } else {
        view.copy_(contribution);
      }
      grad = view;
    }
    if (synced_part_[i].defined()) view.sub_(synced_part_[i]);
    if (b.averaged && !divided) view.div_(world_size_);
  }
  if (flags_work_) {
    // The first launch of a step while the last step's flags are still being summed:
    // this step writes the other buffer (reducer.h, flags_work_). finalize() waited for
    // the one before, so the spare is free.
    std::swap(flags_, spare_flags_);
    std::swap(flags_work_, spare_flags_work_);
    wait_for_flags(flags_work_);  // a no-op: kept in case a failed step left it pending
  }
  at::Tensor flag_slots = flags_.narrow(0, b.first_flag, static_cast<int64_t>(count));
  if (b.complete) {
    flag_slots.fill_(1);
  } else {
    flag_slots.copy_(at::tensor(flags));
  }
  at::Tensor wire = b.flat;
  if (b.wire.defined()) {
    // Each replica's values scaled by 1/N so that the sum stays in the wire's range (and,
    // when averaging, so that it is the mean: then it is not multiplied back).
    cast_copy(b.flat, b.wire, 1.0 / static_cast<double>(world_size_), true);
    wire = b.wire;
  }
  step_bytes_ += wire.numel() * wire.element_size();
  ++step_buckets_;
  if (process_group_) {
    b.work = compat::allreduce(*process_group_, wire);
  } else {
    py::gil_scoped_acquire gil;
    // A fresh alias for Python: the backend may drop its reference after ours.
    const int64_t index = static_cast<int64_t>(&b - buckets_.data());
    b.py_work = launch_bucket_(index, py::cast(wire.alias()));
  }
}

// Waits for a sum of the flags if one is pending, and forgets it. Called without the GIL.
void Reducer::wait_for_flags(compat::WorkPtr& work) {
  if (!work) return;
  compat::WorkPtr pending = std::move(work);
  work.reset();
  wait_work(*pending);
}

namespace {
constexpr std::chrono::milliseconds kInterruptPoll{200};
}  // namespace

bool Reducer::drain(double seconds) {
  if (!interruptible_) return true;
  std::vector<compat::WorkPtr> pending;
  for (const compat::WorkPtr* w : {&flags_work_, &spare_flags_work_}) {
    if (*w) pending.push_back(*w);
  }
  for (const Bucket& b : buckets_) {
    if (b.work) pending.push_back(b.work);
  }
  py::gil_scoped_release no_gil;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(seconds));
  for (const compat::WorkPtr& work : pending) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    try {
      if (left.count() <= 0 || !compat::wait_for(*work, left)) return false;
    } catch (const std::exception&) {
      // it failed: it has ended, which is all that is asked
    }
  }
  return true;
}

// Waits for `work` (started on the process group); see set_interrupted(). Called without
// the GIL.
void Reducer::wait_work(c10d::Work& work) {
  if (!interruptible_) {
    compat::wait(work);
    return;
  }
  while (!compat::wait_for(work, kInterruptPoll)) {
    TORCH_CHECK(!interrupted_.load(),
                "torchstrategy: this replica stopped waiting for the gradient all-reduce: "
                "the group's connections were closed for live recovery (a replica of the "
                "group was lost, or has begun the recovery)");
  }
}

// After the all-reduce: every gradient some replica contributed becomes its view (which
// now holds the sum), plus what was set aside before backward.
void Reducer::settle(Bucket& b) {
  const size_t count = b.params.size();
  if (b.complete) {
    for (size_t k = 0; k < count; ++k) {
      at::Tensor kept = take_kept(b.params[k]);
      if (kept.defined()) b.views[k].add_(kept);
    }
    return;
  }
  at::Tensor flags = flags_.narrow(0, b.first_flag, static_cast<int64_t>(count))
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

at::Tensor Reducer::take_kept(int64_t index) {
  at::Tensor kept;
  if (stash_[index].defined()) {
    std::swap(kept, stash_[index]);
  } else if (synced_part_[index].defined()) {
    std::swap(kept, synced_part_[index]);
  }
  return kept;
}

}  // namespace torchstrategy
