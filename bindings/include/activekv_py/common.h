#pragma once
// Shared glue for ActiveKV's pybind11 modules: torch's type casters (at::Tensor, at::ScalarType, at::Device), the
// exception translation every module registers, and telemetry -> dict conversion. Bindings include the engine
// headers; they never restate engine prototypes.
#include <activekv/kv_state.h>
#include <activekv/telemetry.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>

namespace activekv::py_glue {

namespace py = pybind11;

/// Every module converts tensors, dtypes and devices with torch's casters, which need torch's Python types to be
/// initialised: without `import torch` first, the first conversion would crash the process. Fail the import with a
/// clear ImportError instead. Reads sys.modules only; imports nothing.
inline void require_torch_imported(const char* module) {
  PyObject* modules = PySys_GetObject("modules");  // borrowed
  if (modules == nullptr || !PyDict_Check(modules) || PyDict_GetItemString(modules, "torch._C") == nullptr) {
    throw py::import_error(std::string(module) +
                           " needs torch: run `import torch` before importing it (its tensors, dtypes and devices are "
                           "torch's)");
  }
}

/// The bytes of a str path as os.fsencode() makes them (undecodable bytes come back from their surrogateescape
/// form), or nullopt when the file system encoding cannot encode it (a lone surrogate outside that form).
inline std::optional<std::string> fs_path_of(const py::handle& s) {
  PyObject* bytes = PyUnicode_EncodeFSDefault(s.ptr());
  if (bytes == nullptr) {
    PyErr_Clear();
    return std::nullopt;
  }
  std::string out(PyBytes_AS_STRING(bytes), static_cast<size_t>(PyBytes_GET_SIZE(bytes)));
  Py_DECREF(bytes);
  return out;
}

/// A path argument as the C library will read it: `v` a str, bytes or os.PathLike (os.fspath's rule), a str taken as
/// os.fsencode() encodes it (fs_path_of), with no NUL character (the C library stops at the first: 'a\0b' would name
/// 'a'). @throws c10::TypeError / c10::ValueError naming `what` and the `kind` of path the caller expects.
inline std::string path_arg(const py::handle& v, const std::string& what, const char* kind = "path") {
  const auto repr = [&] { return std::string(py::repr(v)); };
  PyObject* fs = PyOS_FSPath(v.ptr());  // new reference: str or bytes, or nullptr with an error set
  if (fs == nullptr) PyErr_Clear();
  TORCH_CHECK_TYPE(fs != nullptr, what, " must be a str or os.PathLike, got ", repr());
  const auto path = py::reinterpret_steal<py::object>(fs);
  const auto bytes = PyBytes_Check(fs) ? std::optional<std::string>(std::string(
                                             PyBytes_AS_STRING(fs), static_cast<size_t>(PyBytes_GET_SIZE(fs))))
                                       : fs_path_of(path);
  TORCH_CHECK_VALUE(bytes.has_value(), what, " must be a path os.fsencode() can encode, got ", repr());
  TORCH_CHECK_VALUE(bytes->find('\0') == std::string::npos, what, " must be a ", kind, " without NUL characters, got ",
                    repr());
  return *bytes;
}

/// c10::TypeError -> TypeError, c10::ValueError -> ValueError, c10::IndexError -> IndexError,
/// c10::NotImplementedError -> NotImplementedError, other c10::Error -> RuntimeError; messages without backtraces.
inline void register_exceptions(py::module_& m) {
  require_torch_imported(py::str(m.attr("__name__")).cast<std::string>().c_str());
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });
}

/// {block id: pool slot} of a layer's resident blocks.
inline py::dict resident_dict(const LayerState& l) {
  py::dict d;
  for (size_t b = 0; b < l.slot_of_block.size(); ++b)
    if (l.slot_of_block[b] >= 0) d[py::int_(b)] = l.slot_of_block[b];
  return d;
}

/// Histogram -> {"le": [upper bounds], "counts": [per bucket], "count": n, "sum": s}.
inline py::dict histogram_to_dict(const Histogram& h) {
  py::list le, counts;
  for (int i = 0; i < Histogram::kBuckets; ++i) {
    le.append(Histogram::upper_bound(i));
    counts.append(h.counts[i]);
  }
  py::dict d;
  d["le"] = le;
  d["counts"] = counts;
  d["count"] = h.count;
  d["sum"] = h.sum;
  return d;
}

/// Snapshot -> {counter: int, ..., "histograms": {name: histogram dict}, "info": {name: int}}.
inline py::dict snapshot_to_dict(const TelemetrySnapshot& s) {
  py::dict d;
  for (const auto& [name, v] : s.counters) d[py::str(name)] = v;
  py::dict hs;
  for (const auto& [name, h] : s.histograms) hs[py::str(name)] = histogram_to_dict(h);
  d["histograms"] = hs;
  py::dict info;
  for (const auto& [name, v] : s.info) info[py::str(name)] = v;
  d["info"] = info;
  return d;
}

}  // namespace activekv::py_glue
