// Every private torch C++ API csrc/ uses, behind one small interface.
//
// torch keeps no compatibility promise for autograd or c10d internals: they change between
// releases without notice. Only this header includes them, so that a new torch breaks the
// build here, in one place, and each use says which releases it was checked against.
// Checked: torch 2.13.0 (CPU build, compiled and tested). The GPU reference setup runs
// torch 2.11 (+cu130); recheck each use below when moving either.
#pragma once

#include <chrono>

#include <ATen/core/Tensor.h>
// pybind11 with torch's casters (at::Tensor, c10::intrusive_ptr holders): the part of
// <torch/extension.h> csrc/ needs, without torch's whole C++ API (a third of the build).
#include <torch/csrc/utils/pybind.h>

// Private headers, included nowhere else in csrc/.
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace torchstrategy::compat {

// -- autograd internals ------------------------------------------------------------------

// The owning pointer torch hands out for an autograd node: c10::intrusive_ptr in torch
// 2.13, std::shared_ptr in 2.11 (found by the first GPU build, torch 2.11+cu130). Taken
// from the function's own return type so that both build; csrc/ only dereferences it and
// keeps it alive.
using GradAccumulator = decltype(torch::autograd::impl::grad_accumulator(
    std::declval<const at::Tensor&>()));

// The AccumulateGrad node of a leaf (created if need be); null for a non-leaf.
// torch::autograd::impl::grad_accumulator (torch/csrc/autograd/variable.h), torch 2.13.0
// and 2.11.
inline GradAccumulator grad_accumulator(const at::Tensor& leaf) {
  return torch::autograd::impl::grad_accumulator(leaf);
}

// Runs `fn` after `node` ran (for AccumulateGrad: once .grad holds the new gradient).
// Node::add_post_hook (torch/csrc/autograd/function.h) with utils::LambdaPostHook
// (torch/csrc/autograd/utils/lambda_post_hook.h, whose lambda takes (outputs, inputs) and
// returns the outputs), torch 2.13.0.
inline void add_post_hook(torch::autograd::Node& node, std::function<void()> fn) {
  node.add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [fn = std::move(fn)](const torch::autograd::variable_list& outputs,
                           const torch::autograd::variable_list&) {
        fn();
        return outputs;
      }));
}

// Runs `fn` once the current backward pass has run every node; call from inside backward.
// Engine::get_default_engine().queue_callback (torch/csrc/autograd/engine.h), torch 2.13.0.
inline void queue_backward_callback(std::function<void()> fn) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

// -- c10d internals ----------------------------------------------------------------------

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// The C++ process group behind a Python torch.distributed ProcessGroup. Throws for an
// object that is not one (torchstrategy/collectives/reducer.py then goes through Python).
// The pybind11 binding of c10d::ProcessGroup with an intrusive_ptr holder
// (torch/csrc/distributed/c10d/init.cpp, c10d/ProcessGroup.hpp), torch 2.13.0.
inline ProcessGroupPtr process_group_from_python(const pybind11::object& group) {
  return group.cast<ProcessGroupPtr>();
}

// Starts a SUM all-reduce of `tensor` in place.
// ProcessGroup::allreduce(std::vector<at::Tensor>&, AllreduceOptions) (ProcessGroup.hpp),
// torch 2.13.0.
inline WorkPtr allreduce(c10d::ProcessGroup& group, const at::Tensor& tensor) {
  std::vector<at::Tensor> tensors{tensor};
  return group.allreduce(tensors);
}

// Blocks until `work` finished; throws its failure.
// Work::wait(timeout = kNoTimeout) (torch/csrc/distributed/c10d/Work.hpp), torch 2.13.0.
inline void wait(c10d::Work& work) { work.wait(); }

// Waits at most `timeout` for `work`: true once it finished (its failure thrown), false if
// it is still running. Work::wait(timeout) throws c10::Error ("Operation timed out!") when
// the time runs out first (torch/csrc/distributed/c10d/Work.cpp); gloo's AsyncWork keeps
// that base wait (ProcessGroupGloo.hpp), torch 2.13.0. Not for NCCL, whose timed wait
// means something else.
inline bool wait_for(c10d::Work& work, std::chrono::milliseconds timeout) {
  try {
    work.wait(timeout);
    return true;
  } catch (const c10::Error&) {
    if (!work.isCompleted()) return false;
  }
  work.wait();  // finished as the time ran out: its own result, or its own failure
  return true;
}

// Whether `group` is a plain gloo group (ProcessGroup::getBackendName, ProcessGroup.hpp),
// torch 2.13.0.
inline bool is_gloo(const c10d::ProcessGroup& group) {
  return group.getBackendName() == "gloo";
}

}  // namespace torchstrategy::compat
