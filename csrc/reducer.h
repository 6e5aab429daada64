// The gradient reducer's hot path (torchstrategy._C.Reducer): bucket bookkeeping, the
// autograd hooks, launching each full bucket's all-reduce, and settling the gradients
// after backward. torchstrategy/collectives/reducer.py documents the semantics;
// csrc/reducer.cpp implements them without a Python call per parameter, and
// csrc/bucket_layout.h decides which parameters share a bucket.
//
// Locks, and the order they are taken in
// --------------------------------------
// 1. Reducer::mutex_ guards the state the autograd hooks touch. The hooks
//    (before_accumulation, on_ready) run on autograd engine threads without the GIL: the
//    thread that called backward() (torch releases the GIL for the whole pass) or a
//    device's engine thread.
// 2. The GIL.
// 3. Locks inside torch the reducer calls into: the c10d backend's work queue (taken by
//    allreduce and Work::wait), the autograd engine's callback queue (queue_callback).
//
// Rules, which every caller follows:
// - mutex_ may be held while taking the GIL, never the reverse: on_ready() -> launch()
//   takes the GIL for the Python launch_bucket with mutex_ held, so a thread holding the
//   GIL releases it before taking mutex_ (build() and mark_ready() do).
// - Never enqueue a collective or wait on c10d work while holding the GIL: a gloo worker
//   thread releasing a finished work takes the GIL while holding its queue's lock.
//   finalize() releases the GIL for both; the hooks never hold it; a Python
//   all_reduce_async or Work.wait goes through torch's bindings, which release it.
// - mutex_ may be held while calling queue_callback: the engine runs the queued callback
//   after releasing its own lock, and the callback takes only the GIL.
// - finalize(), reset_step(), and the configuration and inspection calls run with the GIL
//   and without mutex_: they run between backward passes or from the engine's final
//   callback, after every hook of that pass returned, so no hook runs beside them.
// - Python objects (the constructor's arguments, a bucket's py_work) are created, copied
//   and destroyed only with the GIL; ~Reducer() takes it, as the last reference can be a
//   hook's on an engine thread.
#pragma once

#include "bucket_layout.h"
#include "compat.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace torchstrategy {

// One flat buffer all-reduced in one collective, and the parameters whose slots it holds.
struct Bucket {
  std::vector<int64_t> params;  // parameter indices, in slot order
  std::vector<int64_t> offsets;
  std::vector<int64_t> numels;
  int64_t first_flag = 0;       // where its "contributed" flags start in Reducer::flags_
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  at::Tensor flat;
  std::vector<at::Tensor> views;
  at::Tensor wire;              // the compressed copy on the wire; undefined: flat travels
  std::vector<char> ready;
  int64_t pending = 0;
  bool complete = false;        // launched with every parameter ready
  bool averaged = false;        // launched with its slots divided by the world size
  compat::WorkPtr work;
  std::optional<pybind11::object> py_work;  // set and cleared with the GIL held
};

// One bucket as bucket_layout() describes it.
struct BucketInfo {
  std::string dtype;              // c10's name of the dtype ("Float")
  std::vector<int64_t> params;    // parameter indices, in slot order
  std::vector<int64_t> offsets;   // each slot's first element (slots packed, as DDP's)
  std::vector<int64_t> numels;    // each slot's elements
  int64_t first_flag = 0;         // its first "contributed" flag in Reducer::flags()
  int64_t elements = 0;           // of the flat buffer: the gradients and nothing else
  std::string wire;               // the wire dtype's name, or "" when the flat travels
};

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  // Buckets go through `process_group` from C++ when it is not None, else through
  // `launch_bucket(bucket index, buffer)`, the Python stage of the pipeline (another
  // algorithm's all-reduce, or error-feedback compression), which returns a handle with
  // `wait()`; the step's "contributed" flags go the same way, as `launch_bucket(-1,
  // flags)`, summed like a bucket. `finalize_callback` is called with the GIL once per
  // backward and must call finalize().
  Reducer(int64_t cap_bytes, int64_t first_cap_bytes, int64_t world_size,
          std::string compression, pybind11::object process_group,
          pybind11::object launch_bucket, pybind11::object finalize_callback);
  ~Reducer();

  // Registers parameters (hooks included); build() must follow.
  void add_parameters(const std::vector<at::Tensor>& params);
  // Lays out the parameters, in `order`, into buckets (GIL held: it is released inside):
  // with `whole`, one bucket per dtype and device (DDP's layout before its first backward,
  // compute_whole_layout), else buckets cut at the caps (compute_bucket_layout).
  void build(const std::vector<int64_t>& order, bool whole);

  void set_sync(bool sync) { sync_ = sync; }
  bool sync() const { return sync_; }

  // Starts recording the order gradients arrive in (the next synchronised backward).
  void start_recording();
  // The recorded arrival order (parameter indices), once a synchronised backward ran.
  std::optional<std::vector<int64_t>> take_arrival();

  // What the post-accumulate-grad hook does, outside backward (benchmarks, tests): marks
  // parameter `index` ready, launching its bucket once full. finalize() must follow.
  // Called without the GIL.
  void mark_ready(int64_t index);
  // Launches the buckets still waiting, waits for every all-reduce and settles the
  // gradients (GIL held). Returns whether this backward was synchronised.
  bool finalize();
  // Clears the per-backward state (GIL held; also after a failed finalize).
  void reset_step();
  // Called from a backward (an autograd node's backward, GIL held): this synchronised
  // backward averages, as DistributedDataParallel: each bucket's slots are divided by the
  // world size before the SUM all-reduce (buckets launched before the call are divided
  // after it). Under no_sync it marks nothing. Returns true: the gradients of this
  // backward, or of the synchronising backward that ends a no_sync accumulation, are
  // left to the reducer to average.
  bool average_this_backward();

  // -- inspection ----------------------------------------------------------------------
  std::vector<int64_t> bucket_sizes() const;
  std::vector<int64_t> bucket_order() const;
  // Per bucket, in launch order: what a Python stage needs to find each parameter's
  // gradient in the flat buffer, as build() laid it out (csrc/bucket_layout.h).
  std::vector<BucketInfo> bucket_layout() const;
  // One "contributed" flag per parameter, bucket after bucket (BucketInfo::first_flag):
  // 1 where this replica gave the parameter a gradient in the step; once summed, how many
  // replicas did. float32, on the first bucket's device; kept outside the buckets, so that
  // a bucket holds exactly DDP's values. Summed when a bucket launched incomplete here
  // settles and, for buckets going through `launch_bucket`, before their handles are
  // waited for; when every bucket launched on the process group was complete here, nothing
  // reads the sum, so it is not waited for (two buffers take turns: see flags_work_).
  at::Tensor flags() const { return flags_; }
  // Whether bucket `index` (launch order) was launched with every parameter ready in this
  // backward: then all of its "contributed" flags are 1 here, and a stage that runs while
  // backward goes on needs not read them (a device sync on a GPU).
  bool bucket_complete(int64_t index) const {
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(buckets_.size()),
                "bucket index ", index, " out of range");
    return buckets_[static_cast<size_t>(index)].complete;
  }
  // True when buckets are launched on the c10d process group from C++; false when they go
  // through the cross-device ops' Python all_reduce_async.
  bool launches_on_process_group() const { return static_cast<bool>(process_group_); }
  bool is_bucket_view(int64_t index) const { return is_view(index, params_[index].grad()); }
  // (bytes reduced, buckets launched, seconds waited, synchronised backward passes).
  std::tuple<int64_t, int64_t, double, int64_t> stats() const {
    return {last_bytes_, last_buckets_, last_waited_, steps_};
  }
  // Live recovery's escape from a gloo collective that cannot complete any more (its group
  // abandoned by a replica that is recovering): after set_interrupted(true), from any
  // thread, a wait of finalize() on the process group gives up within kInterruptPoll and
  // throws an error that says the group's connections were closed; set_interrupted(false)
  // undoes it. A gloo collective does not always fail when its sockets are shut down (seen:
  // a ring's receive that kept waiting for the whole collective timeout), so the wait itself
  // must end. Nothing changes for other backends, or for buckets launched through Python.
  void set_interrupted(bool interrupted) { interrupted_.store(interrupted); }
  // Before a gloo group is abandoned: waits up to `seconds` for the collectives this
  // reducer left in flight (the flags' sum, buckets of a failed step) to end, each as it
  // may (completed or failed); returns whether all did. A collective still running when
  // its connections are shut down may stay stuck until the collective timeout (above), and
  // freeing the group then waits for it. Nothing to wait for on other backends.
  bool drain(double seconds);

 private:
  Bucket allocate(BucketSpec spec) const;
  bool is_view(int64_t index, const at::Tensor& grad) const;
  void before_accumulation(int64_t index);
  void on_ready(int64_t index);
  void queue_finalize();
  void launch(Bucket& b);
  void wait_for_flags(compat::WorkPtr& work);
  void wait_work(c10d::Work& work);
  void settle(Bucket& b);
  at::Tensor take_kept(int64_t index);

  const int64_t cap_;
  const int64_t first_cap_;
  const int64_t world_size_;
  std::optional<at::ScalarType> wire_dtype_;
  compat::ProcessGroupPtr process_group_;
  bool interruptible_ = false;         // a gloo process group: see set_interrupted()
  std::atomic<bool> interrupted_{false};
  pybind11::object launch_bucket_;
  pybind11::object finalize_callback_;

  std::mutex mutex_;
  std::vector<at::Tensor> params_;
  std::vector<compat::GradAccumulator> accumulators_;
  std::vector<Bucket> buckets_;
  at::Tensor flags_;                   // see flags(): this step's
  // The sum of the flags over the process group is waited for only where it is read (a
  // bucket launched incomplete here). Otherwise it stays in flight into the next step,
  // which writes the other buffer: the first launch of a step swaps the two when flags_'s
  // sum is still pending, and finalize() waits for the earlier step's before it starts its
  // own, so at most one is in flight and a buffer is never written while it is summed.
  at::Tensor spare_flags_;
  compat::WorkPtr flags_work_;         // flags_'s sum, started and not waited for
  compat::WorkPtr spare_flags_work_;   // spare_flags_'s sum, started and not waited for
  std::optional<pybind11::object> flags_py_work_;  // set and cleared with the GIL held
  std::vector<std::pair<int64_t, int64_t>> slots_;  // parameter -> (bucket, slot)
  std::vector<char> local_;            // accumulated under no_sync since the last sync
  std::vector<at::Tensor> stash_;      // .grad kept from before this backward
  std::vector<at::Tensor> synced_part_;  // summed part under a no_sync accumulation
  bool sync_ = true;
  bool average_ = false;               // this backward averages (average_this_backward)
  at::Tensor inverse_world_;           // 1 / world_size as a wrapped number, as DDP's
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

}  // namespace torchstrategy
