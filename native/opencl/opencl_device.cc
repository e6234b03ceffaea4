// opencl_device.cc: TVM's DeviceAPI for OpenCL (kDLOpenCL, device type 4), registered as "device_api.opencl".
// The platform is chosen once, lazily: among the platforms MOBILEC_OPENCL_PLATFORM names (a case-insensitive part of
// the platform's name, vendor or version, e.g. "intel" or "pocl"; all when unset), the first with a GPU, else the
// first with any device (PoCL's or Intel's CPU device); one context for its devices and one in-order queue per
// device. A tensor's data pointer is the cl_mem itself, so pointer arithmetic on the host is not allowed (offsets
// travel as byte_offset / from_offset).
#include <tvm/ffi/any.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "opencl_common.h"

namespace mobilec {
namespace opencl {

using tvm::Device;
using tvm::runtime::DeviceAttrKind;

std::string ErrorName(cl_int code) {
  switch (code) {
    case 0: return "CL_SUCCESS";
    case -1: return "CL_DEVICE_NOT_FOUND";
    case -2: return "CL_DEVICE_NOT_AVAILABLE";
    case -3: return "CL_COMPILER_NOT_AVAILABLE";
    case -4: return "CL_MEM_OBJECT_ALLOCATION_FAILURE";
    case -5: return "CL_OUT_OF_RESOURCES";
    case -6: return "CL_OUT_OF_HOST_MEMORY";
    case -7: return "CL_PROFILING_INFO_NOT_AVAILABLE";
    case -8: return "CL_MEM_COPY_OVERLAP";
    case -9: return "CL_IMAGE_FORMAT_MISMATCH";
    case -10: return "CL_IMAGE_FORMAT_NOT_SUPPORTED";
    case -11: return "CL_BUILD_PROGRAM_FAILURE";
    case -12: return "CL_MAP_FAILURE";
    case -13: return "CL_MISALIGNED_SUB_BUFFER_OFFSET";
    case -14: return "CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST";
    case -15: return "CL_COMPILE_PROGRAM_FAILURE";
    case -16: return "CL_LINKER_NOT_AVAILABLE";
    case -17: return "CL_LINK_PROGRAM_FAILURE";
    case -18: return "CL_DEVICE_PARTITION_FAILED";
    case -19: return "CL_KERNEL_ARG_INFO_NOT_AVAILABLE";
    case -30: return "CL_INVALID_VALUE";
    case -31: return "CL_INVALID_DEVICE_TYPE";
    case -32: return "CL_INVALID_PLATFORM";
    case -33: return "CL_INVALID_DEVICE";
    case -34: return "CL_INVALID_CONTEXT";
    case -35: return "CL_INVALID_QUEUE_PROPERTIES";
    case -36: return "CL_INVALID_COMMAND_QUEUE";
    case -37: return "CL_INVALID_HOST_PTR";
    case -38: return "CL_INVALID_MEM_OBJECT";
    case -39: return "CL_INVALID_IMAGE_FORMAT_DESCRIPTOR";
    case -40: return "CL_INVALID_IMAGE_SIZE";
    case -41: return "CL_INVALID_SAMPLER";
    case -42: return "CL_INVALID_BINARY";
    case -43: return "CL_INVALID_BUILD_OPTIONS";
    case -44: return "CL_INVALID_PROGRAM";
    case -45: return "CL_INVALID_PROGRAM_EXECUTABLE";
    case -46: return "CL_INVALID_KERNEL_NAME";
    case -47: return "CL_INVALID_KERNEL_DEFINITION";
    case -48: return "CL_INVALID_KERNEL";
    case -49: return "CL_INVALID_ARG_INDEX";
    case -50: return "CL_INVALID_ARG_VALUE";
    case -51: return "CL_INVALID_ARG_SIZE";
    case -52: return "CL_INVALID_KERNEL_ARGS";
    case -53: return "CL_INVALID_WORK_DIMENSION";
    case -54: return "CL_INVALID_WORK_GROUP_SIZE";
    case -55: return "CL_INVALID_WORK_ITEM_SIZE";
    case -56: return "CL_INVALID_GLOBAL_OFFSET";
    case -57: return "CL_INVALID_EVENT_WAIT_LIST";
    case -58: return "CL_INVALID_EVENT";
    case -59: return "CL_INVALID_OPERATION";
    case -60: return "CL_INVALID_GL_OBJECT";
    case -61: return "CL_INVALID_BUFFER_SIZE";
    case -62: return "CL_INVALID_MIP_LEVEL";
    case -63: return "CL_INVALID_GLOBAL_WORK_SIZE";
    case -64: return "CL_INVALID_PROPERTY";
    case -65: return "CL_INVALID_IMAGE_DESCRIPTOR";
    case -66: return "CL_INVALID_COMPILER_OPTIONS";
    case -67: return "CL_INVALID_LINKER_OPTIONS";
    case -68: return "CL_INVALID_DEVICE_PARTITION_COUNT";
    case -69: return "CL_INVALID_PIPE_SIZE";
    case -70: return "CL_INVALID_DEVICE_QUEUE";
    case -71: return "CL_INVALID_SPEC_ID";
    case -72: return "CL_MAX_SIZE_RESTRICTION_EXCEEDED";
    case -1001: return "CL_PLATFORM_NOT_FOUND_KHR";
    default: return "CL error " + std::to_string(code);
  }
}

void ThrowCLError(const char* call, cl_int code, const std::string& context) {
  // `call` is the whole expression; name only the function.
  std::string fn(call);
  size_t paren = fn.find('(');
  if (paren != std::string::npos) fn = fn.substr(0, paren);
  TVM_FFI_THROW(RuntimeError) << fn << ": " << ErrorName(code) << context;
  TVM_FFI_UNREACHABLE();
}

std::string DeviceString(cl_device_id device, cl_device_info what) {
  size_t size = 0;
  MOBILEC_CL_CALL(clGetDeviceInfo(device, what, 0, nullptr, &size));
  std::string value(size, '\0');
  MOBILEC_CL_CALL(clGetDeviceInfo(device, what, size, value.data(), nullptr));
  while (!value.empty() && value.back() == '\0') value.pop_back();
  return value;
}

std::string Lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text;
}

std::string PlatformString(cl_platform_id platform, cl_platform_info what) {
  size_t size = 0;
  MOBILEC_CL_CALL(clGetPlatformInfo(platform, what, 0, nullptr, &size));
  std::string value(size, '\0');
  MOBILEC_CL_CALL(clGetPlatformInfo(platform, what, size, value.data(), nullptr));
  while (!value.empty() && value.back() == '\0') value.pop_back();
  return value;
}

OpenCLRuntime* OpenCLRuntime::Global() {
  // Never destroyed: kernels and buffers may be released by other static destructors at exit.
  static OpenCLRuntime* runtime = new OpenCLRuntime();
  return runtime;
}

void OpenCLRuntime::Init() {
  std::call_once(init_once_, [this]() {
    cl_uint num_platforms = 0;
    cl_int err = clGetPlatformIDs(0, nullptr, &num_platforms);
    if (err == -1001 /* CL_PLATFORM_NOT_FOUND_KHR */ || (err == CL_SUCCESS && num_platforms == 0)) {
      init_error_ = "no OpenCL platform is installed (the ICD loader found none)";
      return;
    }
    if (err != CL_SUCCESS) {
      init_error_ = "clGetPlatformIDs: " + ErrorName(err);
      return;
    }
    std::vector<cl_platform_id> platforms(num_platforms);
    clGetPlatformIDs(num_platforms, platforms.data(), nullptr);
    if (const char* wanted = std::getenv(kPlatformVariable); wanted != nullptr && *wanted != '\0') {
      std::vector<cl_platform_id> named;
      std::string installed;
      for (cl_platform_id platform : platforms) {
        std::string name = PlatformString(platform, CL_PLATFORM_NAME);
        if (Lower(name + " " + PlatformString(platform, CL_PLATFORM_VENDOR) + " " +
                  PlatformString(platform, CL_PLATFORM_VERSION)).find(Lower(wanted)) != std::string::npos) {
          named.push_back(platform);
        }
        installed += (installed.empty() ? "" : "; ") + name;
      }
      if (named.empty()) {
        init_error_ = std::string(kPlatformVariable) + "=" + wanted +
                      " names no installed OpenCL platform (installed: " + installed + ")";
        return;
      }
      platforms = std::move(named);
    }
    // GPU first, on any platform; else any device type on the first platform that has one.
    std::vector<cl_device_id> chosen;
    cl_platform_id chosen_platform = nullptr;
    for (cl_device_type type : {static_cast<cl_device_type>(CL_DEVICE_TYPE_GPU),
                                static_cast<cl_device_type>(CL_DEVICE_TYPE_ALL)}) {
      for (cl_platform_id platform : platforms) {
        cl_uint n = 0;
        if (clGetDeviceIDs(platform, type, 0, nullptr, &n) != CL_SUCCESS || n == 0) continue;
        chosen.resize(n);
        if (clGetDeviceIDs(platform, type, n, chosen.data(), nullptr) != CL_SUCCESS) {
          chosen.clear();
          continue;
        }
        chosen_platform = platform;
        break;
      }
      if (!chosen.empty()) break;
    }
    if (chosen.empty()) {
      init_error_ = "the OpenCL platforms have no device";
      return;
    }
    cl_context_properties props[] = {CL_CONTEXT_PLATFORM,
                                     reinterpret_cast<cl_context_properties>(chosen_platform), 0};
    cl_context context = clCreateContext(props, static_cast<cl_uint>(chosen.size()), chosen.data(),
                                         nullptr, nullptr, &err);
    if (err != CL_SUCCESS) {
      init_error_ = "clCreateContext: " + ErrorName(err);
      return;
    }
    std::vector<cl_command_queue> queues;
    for (cl_device_id device : chosen) {
      // In order, no profiling: kernels and copies on one device run in the order they were enqueued.
      cl_command_queue queue = clCreateCommandQueue(context, device, 0, &err);
      if (err != CL_SUCCESS) {
        for (cl_command_queue q : queues) clReleaseCommandQueue(q);
        clReleaseContext(context);
        init_error_ = "clCreateCommandQueue: " + ErrorName(err);
        return;
      }
      queues.push_back(queue);
    }
    platform_ = chosen_platform;
    oclgrind_ = PlatformString(chosen_platform, CL_PLATFORM_NAME).find("Oclgrind") != std::string::npos;
    context_ = context;
    devices_ = std::move(chosen);
    queues_ = std::move(queues);
    free_blocks_.resize(devices_.size());
    used_blocks_.resize(devices_.size());
  });
}

void OpenCLRuntime::CheckDevice(int device_id) {
  Init();
  if (devices_.empty()) {
    TVM_FFI_THROW(RuntimeError) << "OpenCL device " << device_id << " is not available: " << init_error_;
  }
  if (device_id < 0 || device_id >= static_cast<int>(devices_.size())) {
    TVM_FFI_THROW(RuntimeError) << "OpenCL device " << device_id << " does not exist: the platform has "
                                << devices_.size() << " device(s)";
  }
}

cl_device_id OpenCLRuntime::device(int device_id) {
  CheckDevice(device_id);
  return devices_[device_id];
}

cl_command_queue OpenCLRuntime::queue(int device_id) {
  CheckDevice(device_id);
  return queues_[device_id];
}

void OpenCLRuntime::SetKernelTiming(bool on) {
  Init();
  if (on == kernel_timing_ || devices_.empty()) return;
  for (size_t i = 0; i < queues_.size(); ++i) {
    MOBILEC_CL_CALL(clFinish(queues_[i]), " (before switching kernel timing)");
    cl_int err = CL_SUCCESS;
    cl_command_queue queue = clCreateCommandQueue(context_, devices_[i], on ? CL_QUEUE_PROFILING_ENABLE : 0, &err);
    if (err != CL_SUCCESS) ThrowCLError("clCreateCommandQueue", err, on ? " with profiling enabled" : "");
    clReleaseCommandQueue(queues_[i]);
    queues_[i] = queue;
  }
  kernel_timing_ = on;
  if (!on) KernelTimes();  // release what was kept
}

void OpenCLRuntime::RecordLaunch(const std::string& kernel, cl_event event) {
  std::lock_guard<std::mutex> lock(launches_mutex_);
  launches_.emplace_back(kernel, event);
}

std::vector<std::pair<std::string, uint64_t>> OpenCLRuntime::KernelTimes() {
  for (cl_command_queue queue : queues_) MOBILEC_CL_CALL(clFinish(queue), " (waiting for the timed kernels)");
  std::vector<std::pair<std::string, cl_event>> launches;
  {
    std::lock_guard<std::mutex> lock(launches_mutex_);
    launches.swap(launches_);
  }
  std::vector<std::pair<std::string, uint64_t>> times;
  for (auto& [kernel, event] : launches) {
    cl_ulong start = 0, end = 0;
    MOBILEC_CL_CALL(clGetEventProfilingInfo(event, CL_PROFILING_COMMAND_START, sizeof(start), &start, nullptr),
                    " (a kernel's start time)");
    MOBILEC_CL_CALL(clGetEventProfilingInfo(event, CL_PROFILING_COMMAND_END, sizeof(end), &end, nullptr),
                    " (a kernel's end time)");
    clReleaseEvent(event);
    times.emplace_back(kernel, end - start);
  }
  return times;
}

cl_mem OpenCLRuntime::CreateBuffer(size_t nbytes) {
  Init();
  if (context_ == nullptr) {
    TVM_FFI_THROW(RuntimeError) << "OpenCL is not available: " << init_error_;
  }
  cl_int err = CL_SUCCESS;
  // An empty tensor still gets a (1-byte) buffer, so that its data pointer is a valid, non-null cl_mem.
  cl_mem mem = clCreateBuffer(context_, CL_MEM_READ_WRITE, std::max<size_t>(nbytes, 1), nullptr, &err);
  if (err != CL_SUCCESS) {
    ThrowCLError("clCreateBuffer", err, " (" + std::to_string(nbytes) + " bytes)");
  }
  return mem;
}

void* OpenCLRuntime::AllocWorkspace(int device_id, size_t nbytes) {
  CheckDevice(device_id);
  const size_t need = std::max<size_t>((nbytes + 255) / 256 * 256, 256);
  std::lock_guard<std::mutex> lock(workspace_mutex_);
  auto& free = free_blocks_[device_id];
  // The smallest free block that fits and wastes at most half of itself.
  auto best = free.end();
  for (auto it = free.begin(); it != free.end(); ++it) {
    if (it->size >= need && it->size <= 2 * need && (best == free.end() || it->size < best->size)) best = it;
  }
  Block block;
  if (best != free.end()) {
    block = *best;
    free.erase(best);
  } else {
    block = Block{need, CreateBuffer(need)};
  }
  used_blocks_[device_id].push_back(block);
  return block.mem;
}

void OpenCLRuntime::FreeWorkspace(int device_id, void* ptr) {
  CheckDevice(device_id);
  std::lock_guard<std::mutex> lock(workspace_mutex_);
  auto& used = used_blocks_[device_id];
  auto it = std::find_if(used.begin(), used.end(), [ptr](const Block& b) { return b.mem == ptr; });
  if (it == used.end()) {
    TVM_FFI_THROW(RuntimeError) << "OpenCL FreeWorkspace: " << ptr << " was not allocated as workspace";
  }
  free_blocks_[device_id].push_back(*it);
  used.erase(it);
}

int64_t OpenCLRuntime::NumWorkspaceBuffers(int device_id) {
  CheckDevice(device_id);
  std::lock_guard<std::mutex> lock(workspace_mutex_);
  return static_cast<int64_t>(free_blocks_[device_id].size() + used_blocks_[device_id].size());
}

namespace {

// "OpenCL 3.0 PoCL ..." -> {3, 0}.
std::pair<int, int> ParseVersion(const std::string& version) {
  int major = 0, minor = 0;
  if (std::sscanf(version.c_str(), "OpenCL %d.%d", &major, &minor) != 2) {
    std::sscanf(version.c_str(), "%d.%d", &major, &minor);
  }
  return {major, minor};
}

class OpenCLDeviceAPI final : public tvm::runtime::DeviceAPI {
 public:
  static OpenCLDeviceAPI* Global() {
    static OpenCLDeviceAPI* api = new OpenCLDeviceAPI();
    return api;
  }

  void SetDevice(Device dev) final {
    OpenCLRuntime::Global()->device(dev.device_id);
    OpenCLRuntime::CurrentDevice() = dev.device_id;
  }

  void GetAttr(Device dev, DeviceAttrKind kind, tvm::ffi::Any* rv) final {
    OpenCLRuntime* rt = OpenCLRuntime::Global();
    if (kind == tvm::runtime::kExist) {
      *rv = static_cast<int64_t>(dev.device_id >= 0 && dev.device_id < rt->NumDevices());
      return;
    }
    cl_device_id d = rt->device(dev.device_id);
    switch (kind) {
      case tvm::runtime::kMaxThreadsPerBlock:
        *rv = static_cast<int64_t>(DeviceValue<size_t>(d, CL_DEVICE_MAX_WORK_GROUP_SIZE, "max work-group size"));
        break;
      case tvm::runtime::kWarpSize:
        // OpenCL 1.2 has no portable subgroup size; TVM's OpenCL schedules assume 1.
        *rv = static_cast<int64_t>(1);
        break;
      case tvm::runtime::kMaxSharedMemoryPerBlock:
        *rv = static_cast<int64_t>(DeviceValue<cl_ulong>(d, CL_DEVICE_LOCAL_MEM_SIZE, "local memory size"));
        break;
      case tvm::runtime::kComputeVersion: {
        auto [major, minor] = ParseVersion(DeviceString(d, CL_DEVICE_VERSION));
        *rv = tvm::ffi::String(std::to_string(major) + "." + std::to_string(minor));
        break;
      }
      case tvm::runtime::kDeviceName:
        *rv = tvm::ffi::String(DeviceString(d, CL_DEVICE_NAME));
        break;
      case tvm::runtime::kMaxClockRate:  // MHz, as OpenCL reports it
        *rv = static_cast<int64_t>(DeviceValue<cl_uint>(d, CL_DEVICE_MAX_CLOCK_FREQUENCY, "max clock"));
        break;
      case tvm::runtime::kMultiProcessorCount:
        *rv = static_cast<int64_t>(DeviceValue<cl_uint>(d, CL_DEVICE_MAX_COMPUTE_UNITS, "compute units"));
        break;
      case tvm::runtime::kMaxThreadDimensions: {
        cl_uint dims = DeviceValue<cl_uint>(d, CL_DEVICE_MAX_WORK_ITEM_DIMENSIONS, "work-item dimensions");
        std::vector<size_t> sizes(std::max<cl_uint>(dims, 3), 1);
        MOBILEC_CL_CALL(clGetDeviceInfo(d, CL_DEVICE_MAX_WORK_ITEM_SIZES, sizeof(size_t) * dims, sizes.data(),
                                        nullptr));
        std::ostringstream os;
        os << "[" << sizes[0] << ", " << sizes[1] << ", " << sizes[2] << "]";
        *rv = tvm::ffi::String(os.str());
        break;
      }
      case tvm::runtime::kApiVersion: {  // the device's OpenCL version as major*100 + minor*10: 300 for 3.0
        auto [major, minor] = ParseVersion(DeviceString(d, CL_DEVICE_VERSION));
        *rv = static_cast<int64_t>(major * 100 + minor * 10);
        break;
      }
      case tvm::runtime::kDriverVersion:
        *rv = tvm::ffi::String(DeviceString(d, CL_DRIVER_VERSION));
        break;
      case tvm::runtime::kL2CacheSizeBytes:
        *rv = static_cast<int64_t>(DeviceValue<cl_ulong>(d, CL_DEVICE_GLOBAL_MEM_CACHE_SIZE, "cache size"));
        break;
      case tvm::runtime::kTotalGlobalMemory:
        *rv = static_cast<int64_t>(DeviceValue<cl_ulong>(d, CL_DEVICE_GLOBAL_MEM_SIZE, "global memory size"));
        break;
      case tvm::runtime::kImagePitchAlignment: {
        cl_uint value = 0;  // an OpenCL 2.0 query: unset where the device does not answer it
        if (clGetDeviceInfo(d, 0x104A /* CL_DEVICE_IMAGE_PITCH_ALIGNMENT */, sizeof(value), &value, nullptr) ==
            CL_SUCCESS) {
          *rv = static_cast<int64_t>(value);
        }
        break;
      }
      default:  // kMaxRegistersPerBlock, kGcnArch, kAvailableGlobalMemory: OpenCL does not tell
        break;
    }
  }

  void* AllocDataSpace(Device dev, size_t nbytes, size_t alignment, DLDataType type_hint) final {
    // clCreateBuffer aligns to CL_DEVICE_MEM_BASE_ADDR_ALIGN, more than TVM asks for.
    OpenCLRuntime::Global()->device(dev.device_id);
    return OpenCLRuntime::Global()->CreateBuffer(nbytes);
  }

  void FreeDataSpace(Device dev, void* ptr) final {
    if (ptr == nullptr) return;
    MOBILEC_CL_CALL(clReleaseMemObject(static_cast<cl_mem>(ptr)));
  }

  void StreamSync(Device dev, TVMStreamHandle stream) final {
    MOBILEC_CL_CALL(clFinish(OpenCLRuntime::Global()->queue(dev.device_id)));
  }

  void* AllocWorkspace(Device dev, size_t nbytes, DLDataType type_hint) final {
    return OpenCLRuntime::Global()->AllocWorkspace(dev.device_id, nbytes);
  }

  void FreeWorkspace(Device dev, void* ptr) final { OpenCLRuntime::Global()->FreeWorkspace(dev.device_id, ptr); }

  bool SupportsDevicePointerArithmeticsOnHost() final { return false; }

 protected:
  void CopyDataFromTo(const void* from, size_t from_offset, void* to, size_t to_offset, size_t num_bytes,
                      Device dev_from, Device dev_to, DLDataType type_hint, TVMStreamHandle stream) final {
    if (num_bytes == 0) return;
    OpenCLRuntime* rt = OpenCLRuntime::Global();
    const bool from_cl = dev_from.device_type == kDLOpenCL, to_cl = dev_to.device_type == kDLOpenCL;
    const bool from_cpu = dev_from.device_type == kDLCPU, to_cpu = dev_to.device_type == kDLCPU;
    const std::string what = " (" + std::to_string(num_bytes) + " bytes)";
    if (from_cl && to_cpu) {
      // Blocking: the host reads the bytes once this returns; the in-order queue runs earlier kernels first.
      MOBILEC_CL_CALL(clEnqueueReadBuffer(rt->queue(dev_from.device_id), static_cast<cl_mem>(const_cast<void*>(from)),
                                          CL_TRUE, from_offset, num_bytes, static_cast<char*>(to) + to_offset, 0,
                                          nullptr, nullptr),
                      what);
    } else if (from_cpu && to_cl) {
      if (to_offset > 0 && rt->oclgrind()) {
        // Oclgrind 21.10's uninitialized-value check marks a whole buffer uninitialized on a host write at an
        // offset, the written bytes too (TVM's paged cache writes its length rows so): write [0, end) in one copy.
        std::vector<char> head(to_offset + num_bytes);
        MOBILEC_CL_CALL(clEnqueueReadBuffer(rt->queue(dev_to.device_id), static_cast<cl_mem>(to), CL_TRUE, 0,
                                            to_offset, head.data(), 0, nullptr, nullptr),
                        what);
        std::memcpy(head.data() + to_offset, static_cast<const char*>(from) + from_offset, num_bytes);
        MOBILEC_CL_CALL(clEnqueueWriteBuffer(rt->queue(dev_to.device_id), static_cast<cl_mem>(to), CL_TRUE, 0,
                                             head.size(), head.data(), 0, nullptr, nullptr),
                        what);
        return;
      }
      // Blocking: the caller may free or reuse its host memory once this returns.
      MOBILEC_CL_CALL(clEnqueueWriteBuffer(rt->queue(dev_to.device_id), static_cast<cl_mem>(to), CL_TRUE, to_offset,
                                           num_bytes, static_cast<const char*>(from) + from_offset, 0, nullptr,
                                           nullptr),
                      what);
    } else if (from_cl && to_cl) {
      cl_command_queue q_from = rt->queue(dev_from.device_id), q_to = rt->queue(dev_to.device_id);
      if (q_from != q_to) MOBILEC_CL_CALL(clFinish(q_to));  // what the destination's queue still has to do
      MOBILEC_CL_CALL(clEnqueueCopyBuffer(q_from, static_cast<cl_mem>(const_cast<void*>(from)), static_cast<cl_mem>(to),
                                          from_offset, to_offset, num_bytes, 0, nullptr, nullptr),
                      what);
      if (q_from != q_to) MOBILEC_CL_CALL(clFinish(q_from));
    } else {
      TVM_FFI_THROW(RuntimeError) << "OpenCL copy from device type " << dev_from.device_type << " to device type "
                                  << dev_to.device_type << " is not supported (only cpu <-> opencl <-> opencl)";
    }
  }
};

}  // namespace

}  // namespace opencl
}  // namespace mobilec

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def_packed("device_api.opencl",
                  [](tvm::ffi::PackedArgs args, tvm::ffi::Any* rv) {
                    tvm::runtime::DeviceAPI* api = mobilec::opencl::OpenCLDeviceAPI::Global();
                    *rv = static_cast<void*>(api);
                  })
      // For tests and diagnostics: the number of devices, and why there are none.
      .def("mobilec.opencl.num_devices", []() { return mobilec::opencl::OpenCLRuntime::Global()->NumDevices(); })
      .def("mobilec.opencl.num_workspace_buffers",
           [](int device_id) { return mobilec::opencl::OpenCLRuntime::Global()->NumWorkspaceBuffers(device_id); })
      .def("mobilec.opencl.init_error",
           []() { return tvm::ffi::String(mobilec::opencl::OpenCLRuntime::Global()->init_error()); })
      .def("mobilec.opencl.time_kernels",
           [](bool on) { mobilec::opencl::OpenCLRuntime::Global()->SetKernelTiming(on); })
      // Each timed launch since the last call, "kernel\tnanoseconds" a line (a string crosses RPC).
      .def("mobilec.opencl.kernel_times", []() {
        std::string out;
        for (const auto& [kernel, ns] : mobilec::opencl::OpenCLRuntime::Global()->KernelTimes()) {
          out += kernel + "\t" + std::to_string(ns) + "\n";
        }
        return tvm::ffi::String(out);
      })
      // Platform, device, OpenCL version and whether it has cl_khr_fp16, tab-separated (a string crosses RPC).
      .def("mobilec.opencl.describe", [](int device_id) {
        mobilec::opencl::OpenCLRuntime* rt = mobilec::opencl::OpenCLRuntime::Global();
        cl_device_id device = rt->device(device_id);
        std::string extensions = mobilec::opencl::DeviceString(device, CL_DEVICE_EXTENSIONS);
        return tvm::ffi::String(mobilec::opencl::PlatformString(rt->platform(), CL_PLATFORM_NAME) + "\t" +
                                mobilec::opencl::DeviceString(device, CL_DEVICE_NAME) + "\t" +
                                mobilec::opencl::DeviceString(device, CL_DEVICE_VERSION) + "\t" +
                                (extensions.find("cl_khr_fp16") != std::string::npos ? "fp16" : "no-fp16"));
      });
}
