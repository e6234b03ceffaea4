// opencl_module.cc: the runtime module of kind "opencl" that TVM's OpenCL codegen embeds in a compiled library,
// and its loader "ffi.Module.load_from_bytes.opencl".
//
// The bytes (TVM's serializer: little-endian, a string is a uint64 length then its bytes, an array a uint64
// count then its items):
//   string fmt                       "cl" (OpenCL C source), or a binary format ("xclbin", "aocx", ...)
//   uint64 n, then n times:          the function-info map
//     string key                     the kernel's name
//     string name                    the same name
//     uint64 k, k x {uint8 code, uint8 bits, uint16 lanes}   arg_types (buffers are handles: code 3, 64 bits)
//     uint64 t, t x string           launch_param_tags ("blockIdx.x", "threadIdx.x", ...)
//     uint64 e, e x int32            arg_extra_tags (0: none)
//   string data                      the source: one "// Function: <name>\n" section per kernel
//
// A kernel is called with its arguments (buffers as cl_mem handles, scalars by arg_types), then one extent per
// launch_param_tag; global size = grid x block, local size = block. Each kernel's section is built into its own
// program, per device, on first use, so that a module of hundreds of kernels builds only those that run.
#include <tvm/ffi/any.h>
#include <tvm/ffi/cast.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/memory.h>
#include <tvm/ffi/reflection/registry.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <unordered_map>

#include "opencl_common.h"

namespace mobilec {
namespace opencl {

namespace {

struct KernelInfo {
  std::string key;
  std::string name;
  std::vector<DLDataType> arg_types;
  std::vector<std::string> launch_param_tags;
  std::vector<int32_t> arg_extra_tags;
};

// ---- TVM's binary serializer, the parts the module uses ----

class Reader {
 public:
  Reader(const char* data, size_t size) : data_(data), size_(size) {}

  template <typename T>
  T Pod(const char* what) {
    Need(sizeof(T), what);
    T value;
    std::memcpy(&value, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  std::string String(const char* what) {
    uint64_t n = Pod<uint64_t>(what);
    Need(n, what);
    std::string s(data_ + pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }
  uint64_t Count(const char* what, size_t min_item_bytes) {
    uint64_t n = Pod<uint64_t>(what);
    if (min_item_bytes != 0 && n > (size_ - pos_) / min_item_bytes) Fail(what);
    return n;
  }
  bool AtEnd() const { return pos_ == size_; }

 private:
  void Need(uint64_t n, const char* what) {
    if (n > size_ - pos_) Fail(what);
  }
  [[noreturn]] void Fail(const char* what) {
    TVM_FFI_THROW(RuntimeError) << "OpenCL module: truncated or corrupt bytes while reading " << what << " at byte "
                                << pos_ << " of " << size_;
    TVM_FFI_UNREACHABLE();
  }
  const char* data_;
  size_t size_;
  size_t pos_{0};
};

class Writer {
 public:
  template <typename T>
  void Pod(T value) {
    out_.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  void String(const std::string& s) {
    Pod<uint64_t>(s.size());
    out_.append(s);
  }
  std::string& out() { return out_; }

 private:
  std::string out_;
};

std::string TypeName(DLDataType t) {
  std::ostringstream os;
  switch (t.code) {
    case kDLInt: os << "int"; break;
    case kDLUInt: os << "uint"; break;
    case kDLFloat: os << "float"; break;
    case kDLOpaqueHandle: os << "handle"; break;
    case kDLBfloat: os << "bfloat"; break;
    case kDLBool: os << "bool"; break;
    default: os << "code" << static_cast<int>(t.code);
  }
  os << static_cast<int>(t.bits);
  if (t.lanes != 1) os << "x" << t.lanes;
  return os.str();
}

// float -> IEEE half bits (round to nearest even), for a float16 scalar argument.
uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffffu;
  if (((x >> 23) & 0xff) == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    uint32_t shift = static_cast<uint32_t>(14 - exp);
    uint32_t half = mant >> shift;
    uint32_t rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1))) ++half;
  return static_cast<uint16_t>(half);
}

// Each "// Function: <name>\n" section of the source, by name.
std::unordered_map<std::string, std::string> SplitSections(const std::string& source) {
  static const std::string marker = "// Function: ";
  std::unordered_map<std::string, std::string> sections;
  size_t at = source.find(marker);
  while (at != std::string::npos) {
    size_t name_begin = at + marker.size();
    size_t name_end = source.find('\n', name_begin);
    if (name_end == std::string::npos) break;
    size_t next = source.find(marker, name_end + 1);
    sections[source.substr(name_begin, name_end - name_begin)] =
        source.substr(name_end + 1, next == std::string::npos ? std::string::npos : next - name_end - 1);
    at = next;
  }
  return sections;
}

// How one kernel's packed arguments become kernel arguments and an NDRange.
struct LaunchPlan {
  enum class Arg { kHandle, kI8, kI16, kI32, kI64, kU8, kU16, kU32, kU64, kF16, kF32, kF64 };
  std::vector<Arg> args;
  std::vector<int> extent_slot;  // per thread tag, in order: 0-2 grid x/y/z, 3-5 block x/y/z
  std::vector<std::string> extent_tag;
  cl_uint work_dim{1};

  static LaunchPlan Make(const KernelInfo& info) {
    LaunchPlan plan;
    for (size_t i = 0; i < info.arg_types.size(); ++i) {
      DLDataType t = info.arg_types[i];
      auto fail = [&]() {
        TVM_FFI_THROW(RuntimeError) << "OpenCL kernel " << info.name << ": argument " << i << " has type "
                                    << TypeName(t) << ", which cannot be passed to an OpenCL kernel";
      };
      if (t.lanes != 1) fail();
      Arg a = Arg::kHandle;
      if (t.code == kDLOpaqueHandle) {
        a = Arg::kHandle;
      } else if (t.code == kDLInt) {
        a = t.bits == 8 ? Arg::kI8 : t.bits == 16 ? Arg::kI16 : t.bits == 32 ? Arg::kI32 : Arg::kI64;
        if (t.bits != 8 && t.bits != 16 && t.bits != 32 && t.bits != 64) fail();
      } else if (t.code == kDLUInt || t.code == kDLBool) {
        a = t.bits <= 8 ? Arg::kU8 : t.bits == 16 ? Arg::kU16 : t.bits == 32 ? Arg::kU32 : Arg::kU64;
        if (t.bits != 1 && t.bits != 8 && t.bits != 16 && t.bits != 32 && t.bits != 64) fail();
      } else if (t.code == kDLFloat) {
        a = t.bits == 16 ? Arg::kF16 : t.bits == 32 ? Arg::kF32 : Arg::kF64;
        if (t.bits != 16 && t.bits != 32 && t.bits != 64) fail();
      } else {
        fail();
      }
      plan.args.push_back(a);
    }
    int highest = 0;
    for (const std::string& tag : info.launch_param_tags) {
      int slot = -1;
      const bool xyz = !tag.empty() && tag.back() >= 'x' && tag.back() <= 'z';
      if (xyz && tag.size() == 10 && tag.compare(0, 9, "blockIdx.") == 0) {
        slot = tag.back() - 'x';
      } else if (xyz && tag.size() == 11 && tag.compare(0, 10, "threadIdx.") == 0) {
        slot = 3 + (tag.back() - 'x');
      } else if (tag == "tirx.use_dyn_shared_memory") {
        TVM_FFI_THROW(RuntimeError) << "OpenCL kernel " << info.name
                                    << ": dynamic shared memory is not supported by the OpenCL runtime";
      } else if (tag.compare(0, 5, "tirx.") == 0) {
        continue;  // a CUDA launch option (programmatic dependent / cooperative launch ...): takes no value
      }
      if (slot < 0) {
        TVM_FFI_THROW(RuntimeError) << "OpenCL kernel " << info.name << ": unsupported launch parameter '" << tag
                                    << "'";
      }
      highest = std::max(highest, slot % 3);
      plan.extent_slot.push_back(slot);
      plan.extent_tag.push_back(tag);
    }
    plan.work_dim = static_cast<cl_uint>(highest + 1);
    return plan;
  }
};

class OpenCLModuleObj : public tvm::ffi::ModuleObj {
 public:
  OpenCLModuleObj(std::string fmt, std::vector<KernelInfo> infos, std::string data)
      : fmt_(std::move(fmt)), infos_(std::move(infos)), data_(std::move(data)) {
    for (size_t i = 0; i < infos_.size(); ++i) index_[infos_[i].key] = i;
    if (fmt_ == "cl") sections_ = SplitSections(data_);
  }

  ~OpenCLModuleObj() {
    for (auto& entry : kernels_) {
      if (entry.second->kernel != nullptr) clReleaseKernel(entry.second->kernel);
    }
    for (auto& entry : programs_) {
      if (entry.second != nullptr) clReleaseProgram(entry.second);
    }
  }

  const char* kind() const final { return "opencl"; }

  int GetPropertyMask() const final {
    return tvm::ffi::Module::kBinarySerializable | tvm::ffi::Module::kRunnable;
  }

  bool ImplementsFunction(const tvm::ffi::String& name) final { return index_.count(std::string(name)) != 0; }

  tvm::ffi::Optional<tvm::ffi::Function> GetFunction(const tvm::ffi::String& name) final {
    auto it = index_.find(std::string(name));
    if (it == index_.end()) return std::nullopt;
    const KernelInfo& info = infos_[it->second];
    auto plan = std::make_shared<LaunchPlan>(LaunchPlan::Make(info));
    tvm::ffi::ObjectPtr<tvm::ffi::Object> self = tvm::ffi::GetObjectPtr<tvm::ffi::Object>(this);
    const KernelInfo* info_ptr = &info;
    return tvm::ffi::Function([self, this, info_ptr, plan](tvm::ffi::PackedArgs args, tvm::ffi::Any* rv) {
      this->Launch(*info_ptr, *plan, args);
    });
  }

  tvm::ffi::Bytes SaveToBytes() const final {
    Writer w;
    w.String(fmt_);
    w.Pod<uint64_t>(infos_.size());
    for (const KernelInfo& info : infos_) {
      w.String(info.key);
      w.String(info.name);
      w.Pod<uint64_t>(info.arg_types.size());
      for (DLDataType t : info.arg_types) {
        w.Pod<uint8_t>(t.code);
        w.Pod<uint8_t>(t.bits);
        w.Pod<uint16_t>(t.lanes);
      }
      w.Pod<uint64_t>(info.launch_param_tags.size());
      for (const std::string& tag : info.launch_param_tags) w.String(tag);
      w.Pod<uint64_t>(info.arg_extra_tags.size());
      for (int32_t tag : info.arg_extra_tags) w.Pod<int32_t>(tag);
    }
    w.String(data_);
    return tvm::ffi::Bytes(std::move(w.out()));
  }

  tvm::ffi::String InspectSource(const tvm::ffi::String& format) const final {
    std::string f(format);
    if (fmt_ == "cl" && (f.empty() || f == "cl" || f == "opencl")) return tvm::ffi::String(data_);
    return tvm::ffi::String();
  }

  tvm::ffi::Array<tvm::ffi::String> GetWriteFormats() const final { return {tvm::ffi::String(fmt_)}; }

  void WriteToFile(const tvm::ffi::String& file_name, const tvm::ffi::String& format) const final {
    std::ofstream out(std::string(file_name), std::ios::binary);
    out.write(data_.data(), static_cast<std::streamsize>(data_.size()));
    if (!out) TVM_FFI_THROW(RuntimeError) << "OpenCL module: cannot write " << file_name;
  }

 private:
  // A built kernel on one device, with the limits it was built under.
  struct Kernel {
    cl_kernel kernel{nullptr};
    size_t work_group_size{0};    // CL_KERNEL_WORK_GROUP_SIZE
    cl_ulong local_mem_size{0};   // CL_KERNEL_LOCAL_MEM_SIZE
    size_t device_max_group{0};   // CL_DEVICE_MAX_WORK_GROUP_SIZE
    size_t max_item[3]{1, 1, 1};  // CL_DEVICE_MAX_WORK_ITEM_SIZES
    cl_ulong device_local_mem{0}; // CL_DEVICE_LOCAL_MEM_SIZE
    std::string device_name;
    std::mutex mutex;             // clSetKernelArg + enqueue are not thread-safe on one cl_kernel
  };

  // MOBILEC_OPENCL_TRACE=1: one line on stderr per launch (kernel, sizes, scalar arguments).
  static bool Trace() {
    static const bool trace = [] {
      const char* v = std::getenv("MOBILEC_OPENCL_TRACE");
      return v != nullptr && *v != '\0' && std::string(v) != "0";
    }();
    return trace;
  }

  static const char* BuildOptions() {
    const char* options = std::getenv("MOBILEC_OPENCL_BUILD_OPTIONS");
    return options != nullptr ? options : "";
  }

  // The program that holds `name` on device `device_id`, built on first use.
  cl_program Program(const std::string& name, int device_id, cl_device_id device) {
    auto section = sections_.find(name);
    const bool own_section = section != sections_.end();
    const std::string key = (own_section ? name : std::string()) + "@" + std::to_string(device_id);
    auto found = programs_.find(key);
    if (found != programs_.end()) return found->second;
    OpenCLRuntime* rt = OpenCLRuntime::Global();
    cl_int err = CL_SUCCESS;
    cl_program program = nullptr;
    if (fmt_ == "cl") {
      const std::string& source = own_section ? section->second : data_;
      const char* text = source.c_str();
      size_t length = source.size();
      program = clCreateProgramWithSource(rt->context(), 1, &text, &length, &err);
      if (err != CL_SUCCESS) ThrowCLError("clCreateProgramWithSource", err, " for kernel " + name);
    } else {
      const unsigned char* bin = reinterpret_cast<const unsigned char*>(data_.data());
      size_t length = data_.size();
      cl_int status = CL_SUCCESS;
      program = clCreateProgramWithBinary(rt->context(), 1, &device, &length, &bin, &status, &err);
      if (err != CL_SUCCESS) {
        ThrowCLError("clCreateProgramWithBinary", err, " for kernel " + name + " (format " + fmt_ + ")");
      }
    }
    err = clBuildProgram(program, 1, &device, BuildOptions(), nullptr, nullptr);
    if (err != CL_SUCCESS) {
      size_t log_size = 0;
      clGetProgramBuildInfo(program, device, CL_PROGRAM_BUILD_LOG, 0, nullptr, &log_size);
      std::string log(log_size, '\0');
      clGetProgramBuildInfo(program, device, CL_PROGRAM_BUILD_LOG, log_size, log.data(), nullptr);
      while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
      clReleaseProgram(program);
      ThrowCLError("clBuildProgram", err,
                   " for kernel " + name + " on " + DeviceString(device, CL_DEVICE_NAME) + "; build log:\n" + log);
    }
    programs_[key] = program;
    return program;
  }

  Kernel& GetKernel(const KernelInfo& info, int device_id) {
    std::lock_guard<std::mutex> lock(build_mutex_);
    const std::string key = info.name + "@" + std::to_string(device_id);
    auto found = kernels_.find(key);
    if (found != kernels_.end()) return *found->second;
    cl_device_id device = OpenCLRuntime::Global()->device(device_id);
    cl_program program = Program(info.name, device_id, device);
    auto k = std::make_unique<Kernel>();
    cl_int err = CL_SUCCESS;
    k->kernel = clCreateKernel(program, info.name.c_str(), &err);
    if (err != CL_SUCCESS) ThrowCLError("clCreateKernel", err, " for kernel " + info.name);
    MOBILEC_CL_CALL(clGetKernelWorkGroupInfo(k->kernel, device, CL_KERNEL_WORK_GROUP_SIZE, sizeof(size_t),
                                             &k->work_group_size, nullptr),
                    " for kernel " + info.name);
    MOBILEC_CL_CALL(clGetKernelWorkGroupInfo(k->kernel, device, CL_KERNEL_LOCAL_MEM_SIZE, sizeof(cl_ulong),
                                             &k->local_mem_size, nullptr),
                    " for kernel " + info.name);
    k->device_max_group = DeviceValue<size_t>(device, CL_DEVICE_MAX_WORK_GROUP_SIZE, "max work-group size");
    k->device_local_mem = DeviceValue<cl_ulong>(device, CL_DEVICE_LOCAL_MEM_SIZE, "local memory size");
    cl_uint dims = DeviceValue<cl_uint>(device, CL_DEVICE_MAX_WORK_ITEM_DIMENSIONS, "work-item dimensions");
    std::vector<size_t> items(std::max<cl_uint>(dims, 3), 1);
    MOBILEC_CL_CALL(clGetDeviceInfo(device, CL_DEVICE_MAX_WORK_ITEM_SIZES, sizeof(size_t) * dims, items.data(),
                                    nullptr));
    for (int i = 0; i < 3; ++i) k->max_item[i] = items[i];
    k->device_name = DeviceString(device, CL_DEVICE_NAME);
    Kernel& ref = *k;
    kernels_[key] = std::move(k);
    return ref;
  }

  void Launch(const KernelInfo& info, const LaunchPlan& plan, const tvm::ffi::PackedArgs& args) {
    const size_t nargs = plan.args.size();
    if (static_cast<size_t>(args.size()) != nargs + plan.extent_slot.size()) {
      TVM_FFI_THROW(RuntimeError) << "OpenCL kernel " << info.name << " takes " << nargs << " arguments and "
                                  << plan.extent_slot.size() << " launch extents, got " << args.size()
                                  << " values";
    }
    size_t extent[6] = {1, 1, 1, 1, 1, 1};
    for (size_t j = 0; j < plan.extent_slot.size(); ++j) {
      int64_t value = args[static_cast<int>(nargs + j)].cast<int64_t>();
      if (value < 0) {
        TVM_FFI_THROW(RuntimeError) << "OpenCL kernel " << info.name << ": negative launch extent " << value
                                    << " for " << plan.extent_tag[j];
      }
      // A zero extent (a dynamic dimension of size 0) means no work at all.
      if (value == 0) return;
      extent[plan.extent_slot[j]] = static_cast<size_t>(value);
    }
    const int device_id = OpenCLRuntime::CurrentDevice();
    Kernel& k = GetKernel(info, device_id);
    size_t global[3], local[3];
    for (int i = 0; i < 3; ++i) {
      local[i] = extent[3 + i];
      global[i] = extent[i] * extent[3 + i];
    }
    const size_t group = local[0] * local[1] * local[2];
    const size_t limit = std::min(k.work_group_size, k.device_max_group);
    if (group > limit || local[0] > k.max_item[0] || local[1] > k.max_item[1] || local[2] > k.max_item[2]) {
      TVM_FFI_THROW(RuntimeError) << "OpenCL kernel " << info.name << ": a work-group of " << group
                                  << " work-items (" << local[0] << " x " << local[1] << " x " << local[2]
                                  << ") is over the limit of " << k.device_name << ": " << limit
                                  << " work-items for this kernel (CL_KERNEL_WORK_GROUP_SIZE " << k.work_group_size
                                  << ", CL_DEVICE_MAX_WORK_GROUP_SIZE " << k.device_max_group
                                  << "), at most [" << k.max_item[0] << ", " << k.max_item[1] << ", "
                                  << k.max_item[2] << "] per dimension";
    }
    if (k.local_mem_size > k.device_local_mem) {
      TVM_FFI_THROW(RuntimeError) << "OpenCL kernel " << info.name << " uses " << k.local_mem_size
                                  << " bytes of local memory, over the " << k.device_local_mem << " bytes of "
                                  << k.device_name << " (CL_DEVICE_LOCAL_MEM_SIZE)";
    }
    std::lock_guard<std::mutex> lock(k.mutex);
    for (size_t i = 0; i < nargs; ++i) SetArg(info, k.kernel, static_cast<cl_uint>(i), plan.args[i], args[i]);
    if (Trace()) {
      std::ostringstream os;
      os << "[mobilec opencl] " << info.name << " global " << global[0] << "x" << global[1] << "x" << global[2]
         << " local " << local[0] << "x" << local[1] << "x" << local[2] << " args";
      for (size_t i = 0; i < nargs; ++i) {
        if (plan.args[i] == LaunchPlan::Arg::kHandle) {
          os << " buf";
        } else if (args[i].type_index() == tvm::ffi::TypeIndex::kTVMFFIFloat) {
          os << " " << args[i].cast<double>();
        } else {
          os << " " << args[i].cast<int64_t>();
        }
      }
      std::fprintf(stderr, "%s\n", os.str().c_str());
    }
    OpenCLRuntime* rt = OpenCLRuntime::Global();
    cl_event event = nullptr;
    cl_int err = clEnqueueNDRangeKernel(rt->queue(device_id), k.kernel, plan.work_dim, nullptr, global, local, 0,
                                        nullptr, rt->kernel_timing() ? &event : nullptr);
    if (err == CL_SUCCESS && event != nullptr) rt->RecordLaunch(info.name, event);
    if (err != CL_SUCCESS) {
      std::ostringstream os;
      os << " in kernel " << info.name << " (global " << global[0] << " x " << global[1] << " x " << global[2]
         << ", local " << local[0] << " x " << local[1] << " x " << local[2] << ")";
      ThrowCLError("clEnqueueNDRangeKernel", err, os.str());
    }
  }

  static void SetArg(const KernelInfo& info, cl_kernel kernel, cl_uint index, LaunchPlan::Arg kind,
                     tvm::ffi::AnyView value) {
    using Arg = LaunchPlan::Arg;
    const std::string where = " for argument " + std::to_string(index) + " of kernel " + info.name;
    auto set = [&](size_t size, const void* ptr) {
      cl_int err = clSetKernelArg(kernel, index, size, ptr);
      if (err != CL_SUCCESS) ThrowCLError("clSetKernelArg", err, where);
    };
    switch (kind) {
      case Arg::kHandle: {
        cl_mem mem = nullptr;
        int32_t type_index = value.type_index();
        if (type_index == tvm::ffi::TypeIndex::kTVMFFIOpaquePtr) {
          mem = static_cast<cl_mem>(value.cast<void*>());
        } else if (type_index == tvm::ffi::TypeIndex::kTVMFFINone) {
          mem = nullptr;
        } else if (type_index == tvm::ffi::TypeIndex::kTVMFFIDLTensorPtr ||
                   type_index == tvm::ffi::TypeIndex::kTVMFFITensor) {
          DLTensor* t = value.cast<DLTensor*>();
          if (t->device.device_type != kDLOpenCL) {
            TVM_FFI_THROW(RuntimeError) << "OpenCL kernel " << info.name << ": argument " << index
                                        << " is a tensor on device type " << t->device.device_type
                                        << ", not on OpenCL";
          }
          if (t->byte_offset != 0) {
            TVM_FFI_THROW(RuntimeError) << "OpenCL kernel " << info.name << ": argument " << index
                                        << " has byte_offset " << t->byte_offset
                                        << "; an OpenCL buffer argument is the whole cl_mem";
          }
          mem = static_cast<cl_mem>(t->data);
        } else {
          TVM_FFI_THROW(RuntimeError) << "OpenCL kernel " << info.name << ": argument " << index
                                      << " should be a buffer (cl_mem handle), got " << value.GetTypeKey();
        }
        set(sizeof(cl_mem), &mem);
        break;
      }
      case Arg::kI8: { int8_t v = static_cast<int8_t>(value.cast<int64_t>()); set(sizeof(v), &v); break; }
      case Arg::kI16: { int16_t v = static_cast<int16_t>(value.cast<int64_t>()); set(sizeof(v), &v); break; }
      case Arg::kI32: { int32_t v = static_cast<int32_t>(value.cast<int64_t>()); set(sizeof(v), &v); break; }
      case Arg::kI64: { int64_t v = value.cast<int64_t>(); set(sizeof(v), &v); break; }
      case Arg::kU8: { uint8_t v = static_cast<uint8_t>(value.cast<int64_t>()); set(sizeof(v), &v); break; }
      case Arg::kU16: { uint16_t v = static_cast<uint16_t>(value.cast<int64_t>()); set(sizeof(v), &v); break; }
      case Arg::kU32: { uint32_t v = static_cast<uint32_t>(value.cast<int64_t>()); set(sizeof(v), &v); break; }
      case Arg::kU64: { uint64_t v = static_cast<uint64_t>(value.cast<int64_t>()); set(sizeof(v), &v); break; }
      case Arg::kF16: { uint16_t v = FloatToHalf(static_cast<float>(value.cast<double>())); set(sizeof(v), &v); break; }
      case Arg::kF32: { float v = static_cast<float>(value.cast<double>()); set(sizeof(v), &v); break; }
      case Arg::kF64: { double v = value.cast<double>(); set(sizeof(v), &v); break; }
    }
  }

  std::string fmt_;
  std::vector<KernelInfo> infos_;
  std::string data_;
  std::unordered_map<std::string, size_t> index_;
  std::unordered_map<std::string, std::string> sections_;
  std::mutex build_mutex_;
  std::map<std::string, cl_program> programs_;
  std::map<std::string, std::unique_ptr<Kernel>> kernels_;
};

tvm::ffi::Module LoadFromBytes(const tvm::ffi::Bytes& bytes) {
  Reader r(bytes.data(), bytes.size());
  std::string fmt = r.String("the format");
  uint64_t n = r.Count("the function-info count", 8 * 5);
  std::vector<KernelInfo> infos;
  for (uint64_t i = 0; i < n; ++i) {
    KernelInfo info;
    info.key = r.String("a function-info key");
    info.name = r.String("a function name");
    uint64_t nargs = r.Count("an argument count", 4);
    for (uint64_t j = 0; j < nargs; ++j) {
      DLDataType t;
      t.code = r.Pod<uint8_t>("an argument type");
      t.bits = r.Pod<uint8_t>("an argument type");
      t.lanes = r.Pod<uint16_t>("an argument type");
      info.arg_types.push_back(t);
    }
    uint64_t ntags = r.Count("a launch-parameter count", 8);
    for (uint64_t j = 0; j < ntags; ++j) info.launch_param_tags.push_back(r.String("a launch parameter"));
    uint64_t nextra = r.Count("an argument-tag count", 4);
    for (uint64_t j = 0; j < nextra; ++j) info.arg_extra_tags.push_back(r.Pod<int32_t>("an argument tag"));
    for (int32_t tag : info.arg_extra_tags) {
      if (tag != 0) {
        TVM_FFI_THROW(RuntimeError) << "OpenCL kernel " << info.name << ": argument tag " << tag
                                    << " (a CUDA tensor map) is not supported on OpenCL";
      }
    }
    infos.push_back(std::move(info));
  }
  std::string data = r.String("the kernel source");
  if (!r.AtEnd()) {
    TVM_FFI_THROW(RuntimeError) << "OpenCL module: unexpected bytes after the kernel source";
  }
  return tvm::ffi::Module(tvm::ffi::make_object<OpenCLModuleObj>(std::move(fmt), std::move(infos), std::move(data)));
}

}  // namespace

}  // namespace opencl
}  // namespace mobilec

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("ffi.Module.load_from_bytes.opencl", mobilec::opencl::LoadFromBytes)
      // An "opencl" module as this runtime's: what tvm.compile leaves in memory is the codegen's placeholder,
      // which cannot launch; its bytes (the same format) load as a module that can.
      .def("mobilec.opencl.module_from", [](tvm::ffi::Module module) {
        if (std::string(module->kind()) != "opencl") {
          TVM_FFI_THROW(RuntimeError) << "mobilec.opencl.module_from: a module of kind '" << module->kind()
                                      << "', not 'opencl'";
        }
        return mobilec::opencl::LoadFromBytes(module->SaveToBytes());
      });
}
