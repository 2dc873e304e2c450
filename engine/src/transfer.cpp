#include <activekv/check.h>
#include <activekv/geometry.h>
#include <activekv/transfer.h>

namespace activekv {

at::Tensor index_tensor(const std::vector<int64_t>& ids, at::Device device) {
  auto t = at::empty({static_cast<int64_t>(ids.size())}, at::TensorOptions().dtype(at::kLong));
  std::copy(ids.begin(), ids.end(), t.data_ptr<int64_t>());
  return t.to(device);
}

int64_t copy_blocks(const at::Tensor& src, const at::Tensor& dst, const std::vector<int64_t>& src_ids,
                    const std::vector<int64_t>& dst_ids) {
  AKV_CHECK_VALUE(src.dim() >= 1 && dst.dim() == src.dim() && src.sizes().slice(1) == dst.sizes().slice(1),
                  "src and dst must share their trailing block shape, got src ", shape_str(src.sizes()), " and dst ",
                  shape_str(dst.sizes()));
  AKV_CHECK_TYPE(src.scalar_type() == dst.scalar_type(), "src and dst must share a dtype, got ", src.scalar_type(),
                 " and ", dst.scalar_type());
  check_has_data(src, "src");
  check_writable(dst, "dst");
  AKV_CHECK_VALUE(src_ids.size() == dst_ids.size(), "src_ids and dst_ids must have equal lengths, got ",
                  src_ids.size(), " and ", dst_ids.size());
  std::vector<bool> written(dst.size(0), false);
  for (size_t i = 0; i < src_ids.size(); ++i) {
    AKV_CHECK_INDEX(src_ids[i] >= 0 && src_ids[i] < src.size(0), "src_ids[", i, "] must be in [0, ", src.size(0),
                    "), got ", src_ids[i]);
    AKV_CHECK_INDEX(dst_ids[i] >= 0 && dst_ids[i] < dst.size(0), "dst_ids[", i, "] must be in [0, ", dst.size(0),
                    "), got ", dst_ids[i]);
    // Two copies into one block would leave which one lands unspecified (index_copy_ does not order them).
    AKV_CHECK_VALUE(!written[dst_ids[i]], "dst_ids[", i, "] = ", dst_ids[i], " repeats an earlier destination block");
    written[dst_ids[i]] = true;
  }
  if (src_ids.empty()) return 0;
  // One gather and one scatter for the whole batch: two ATen ops whatever the block count.
  auto gathered = src.index_select(0, index_tensor(src_ids, src.device()));
  dst.index_copy_(0, index_tensor(dst_ids, dst.device()), gathered.to(dst.device()));
  return static_cast<int64_t>(src_ids.size()) * (src.numel() / std::max<int64_t>(src.size(0), 1)) *
         static_cast<int64_t>(src.element_size());
}

}  // namespace activekv
