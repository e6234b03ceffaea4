// opencl_common.h: what the OpenCL device (opencl_device.cc) and the OpenCL module (opencl_module.cc) share:
// the OpenCL error names and the check macro that turns a failed call into a TVM error, and OpenCLRuntime, the
// process-wide state (platform, one context, one in-order queue per device), initialized lazily.
#ifndef MOBILEC_NATIVE_OPENCL_COMMON_H_
#define MOBILEC_NATIVE_OPENCL_COMMON_H_

#ifndef CL_TARGET_OPENCL_VERSION
#define CL_TARGET_OPENCL_VERSION 120  // the 1.2 API: what every Adreno/Mali driver has
#endif
#include <CL/cl.h>
#include <tvm/ffi/error.h>
#include <tvm/runtime/device_api.h>

#include <cstddef>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace mobilec {
namespace opencl {

// "CL_INVALID_WORK_GROUP_SIZE" for -54; "CL error -1234" for a code the headers do not name.
std::string ErrorName(cl_int code);

// Throws a TVM RuntimeError "<call>: <CL error name><context>" when `code` is not CL_SUCCESS.
[[noreturn]] void ThrowCLError(const char* call, cl_int code, const std::string& context);

#define MOBILEC_CL_CALL(call, ...)                                                \
  do {                                                                            \
    cl_int mobilec_cl_err_ = (call);                                              \
    if (mobilec_cl_err_ != CL_SUCCESS) {                                          \
      ::mobilec::opencl::ThrowCLError(#call, mobilec_cl_err_, std::string(__VA_ARGS__)); \
    }                                                                             \
  } while (0)

// Strings and fixed-size values from clGetDeviceInfo / clGetPlatformInfo.
std::string DeviceString(cl_device_id device, cl_device_info what);
std::string PlatformString(cl_platform_id platform, cl_platform_info what);
// The environment variable that picks the platform (opencl_device.cc; compiler/runtime/opencl_device.py names it).
inline constexpr char kPlatformVariable[] = "MOBILEC_OPENCL_PLATFORM";
template <typename T>
T DeviceValue(cl_device_id device, cl_device_info what, const char* name) {
  T value{};
  cl_int err = clGetDeviceInfo(device, what, sizeof(T), &value, nullptr);
  if (err != CL_SUCCESS) ThrowCLError("clGetDeviceInfo", err, std::string(" for ") + name);
  return value;
}

// The devices of one platform: GPUs when the first platform with a GPU has them, else every device of the first
// platform that has any (PoCL's CPU device). One context holds them all, one in-order queue each.
class OpenCLRuntime {
 public:
  static OpenCLRuntime* Global();

  // Initializes on first call; never throws for "no platform" (then NumDevices() is 0 and init_error() says why).
  void Init();
  int NumDevices() {
    Init();
    return static_cast<int>(devices_.size());
  }
  const std::string& init_error() {
    Init();
    return init_error_;
  }
  // The device / queue of a TVM device id; throws a clear error when it does not exist.
  cl_device_id device(int device_id);
  cl_command_queue queue(int device_id);
  cl_context context() {
    Init();
    return context_;
  }
  cl_platform_id platform() {
    Init();
    return platform_;
  }
  // Whether the platform is Oclgrind (a simulator that checks kernels; see CopyDataFromTo).
  bool oclgrind() {
    Init();
    return oclgrind_;
  }
  // Buffers for TVM's workspace (kernels' temporaries): reused by size, per device.
  void* AllocWorkspace(int device_id, size_t nbytes);
  void FreeWorkspace(int device_id, void* ptr);
  // How many workspace buffers device `device_id` holds (in use or free): what tests see of the reuse.
  int64_t NumWorkspaceBuffers(int device_id);

  cl_mem CreateBuffer(size_t nbytes);

  // Device times per kernel launch (`mobilec profile`): on, every queue is made anew with profiling enabled and each
  // launch's event is kept; KernelTimes() waits for the queues and returns (kernel, nanoseconds) per launch since the
  // last call. Switch it between steps: the queues are replaced.
  void SetKernelTiming(bool on);
  bool kernel_timing() const { return kernel_timing_; }
  void RecordLaunch(const std::string& kernel, cl_event event);
  std::vector<std::pair<std::string, uint64_t>> KernelTimes();

  // The device that kernels launch on in this thread: what TVM's host code last set (__tvm_set_device).
  static int& CurrentDevice() {
    static thread_local int device_id = 0;
    return device_id;
  }

 private:
  OpenCLRuntime() = default;
  void CheckDevice(int device_id);

  std::once_flag init_once_;
  std::string init_error_;
  cl_platform_id platform_{nullptr};
  bool oclgrind_{false};
  cl_context context_{nullptr};
  std::vector<cl_device_id> devices_;
  std::vector<cl_command_queue> queues_;
  bool kernel_timing_{false};
  std::mutex launches_mutex_;
  std::vector<std::pair<std::string, cl_event>> launches_;  // while timing: each launch's event, in order

  struct Block {
    size_t size;
    cl_mem mem;
  };
  std::mutex workspace_mutex_;
  std::vector<std::vector<Block>> free_blocks_;  // per device: workspace blocks not in use
  std::vector<std::vector<Block>> used_blocks_;  // per device: handed out
};

}  // namespace opencl
}  // namespace mobilec

#endif  // MOBILEC_NATIVE_OPENCL_COMMON_H_
