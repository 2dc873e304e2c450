#pragma once
// Reading vLLM's Python objects into plain C++ values for the _backend module: an attribute or value as a C++ type,
// text as UTF-8, and the errors naming what was expected and what came where pybind11's own casts say neither
// ("Unable to cast Python instance of type ... to C++ type '?'"). Attribute reads only: nothing here imports a module
// or calls a Python callable.
#include <activekv_py/common.h>

#include <string>

namespace activekv::py_glue {

/// `v` as T, or a TypeError "<what> must be <expected>, got <repr>".
template <typename T>
T cast_named(const py::handle& v, const std::string& what, const char* expected) {
  try {
    return v.cast<T>();
  } catch (const py::cast_error&) {
    C10_THROW_ERROR(TypeError, c10::str(what, " must be ", expected, ", got ", std::string(py::repr(v))));
  }
}

/// Attribute `name` of a vLLM object (`owner` in messages) as T: a named TypeError if it is missing or of another type.
template <typename T>
T attr_as(const py::handle& obj, const char* owner, const char* name, const char* expected) {
  TORCH_CHECK_TYPE(py::hasattr(obj, name), owner, ".", name, " is missing (expected ", expected, "), got a ",
                   std::string(py::str(py::type::of(obj))));
  return cast_named<T>(obj.attr(name), std::string(owner) + "." + name, expected);
}

/// A Python str as UTF-8, or a named error: TypeError for another type, ValueError for a str that UTF-8 cannot hold (a
/// lone surrogate).
inline std::string utf8_str(const py::handle& v, const std::string& what) {
  TORCH_CHECK_TYPE(py::isinstance<py::str>(v), what, " must be a str, got ", std::string(py::repr(v)));
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(v.ptr(), &size);
  if (data == nullptr) {
    PyErr_Clear();
    C10_THROW_ERROR(ValueError, c10::str(what, " must be text UTF-8 can encode, got ", std::string(py::repr(v)),
                                         " (it holds a lone surrogate)"));
  }
  return std::string(data, static_cast<size_t>(size));
}

/// A vLLM attention layer's layer_name.
inline std::string layer_name(const py::handle& layer) {
  TORCH_CHECK_TYPE(py::hasattr(layer, "layer_name"), "layer must be a vLLM attention layer with a layer_name, got ",
                   std::string(py::str(py::type::of(layer))));
  return utf8_str(layer.attr("layer_name"), "layer.layer_name");
}

/// An int attribute at obj.a.b, or -1 where either is missing or not an int.
inline int64_t int_attr_or(const py::handle& obj, const char* a, const char* b) {
  if (!py::hasattr(obj, a)) return -1;
  py::object inner = obj.attr(a);
  if (inner.is_none() || !py::hasattr(inner, b)) return -1;
  py::object v = inner.attr(b);
  if (!py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v)) return -1;
  return v.cast<int64_t>();
}

}  // namespace activekv::py_glue
