#pragma once
//! The libfabric objects of one fabric_transport: fabric, domain, one CQ and one AV shared by its three RDM
//! endpoints (matching, bulk, control; fabric.hpp says why three), and every rank's address of each, exchanged
//! through the rendezvous store.
#include <array>
#include <cstddef>
#include <string>
#include <vector>

#include "shardkit/transport/fabric/detail/resources.hpp"
#include "shardkit/transport/fabric/detail/shm_regions.hpp"
#include "shardkit/transport/fabric/detail/wire.hpp"

namespace shardkit::transport::detail::fabric {

enum class endpoint_role : std::size_t { matching = 0, bulk = 1, control = 2 };

class endpoint_set {
 public:
  static constexpr std::size_t count = 3;

  //! Opens everything, publishes this rank's addresses under "<prefix>/<generation>/addr/<rank>" and inserts
  //! every rank's (waiting up to opts.connect_timeout for them).
  endpoint_set(const fabric_options& opts, rendezvous::any_store& store, int rank, int size) : size_(size) {
    const error_context ctx{.rank = rank, .operation = "fabric.create"};
    info_ = query(opts, rank);
    provider_ = info_->fabric_attr->prov_name ? info_->fabric_attr->prov_name : opts.provider;
    fid_fabric* fabric = nullptr;
    check("fi_fabric", fi_fabric(info_->fabric_attr, &fabric, nullptr), ctx);
    fabric_.reset(fabric);
    fid_domain* domain = nullptr;
    check("fi_domain", fi_domain(fabric_.get(), info_.get(), &domain, nullptr), ctx);
    domain_.reset(domain);
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_TAGGED;
    cq_attr.wait_obj = FI_WAIT_NONE;
    cq_attr.size = 4096;
    fid_cq* cq = nullptr;
    check("fi_cq_open", fi_cq_open(domain_.get(), &cq_attr, &cq, nullptr), ctx);
    cq_.reset(cq);
    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    av_attr.count = count * std::size_t(size);
    fid_av* av = nullptr;
    check("fi_av_open", fi_av_open(domain_.get(), &av_attr, &av, nullptr), ctx);
    av_.reset(av);
    // shm names each endpoint's region after it: ours are unique per process start (shm_regions.hpp says why),
    // and the regions that killed ranks of this scheme left behind go first.
    shm_ = provider_ == "shm";
    if (shm_) sweep_dead_shm_regions();
    for (auto& ep : eps_) ep = open_endpoint(ctx);

    address_record mine{provider_, {}};
    for (auto& ep : eps_) mine.names.push_back(name_of(ep.get(), ctx));
    // The k-th create() of every rank lands in generation k (a generation completes only when all ranks joined).
    const auto joined = store.add(opts.prefix + "/joined", 1);
    const std::string prefix = opts.prefix + "/" + std::to_string((joined - 1) / size) + "/addr/";
    store.set(prefix + std::to_string(rank), mine.encode());
    std::vector<address_record> records;
    for (int r = 0; r < size; ++r) {
      auto record = address_record::decode(store.get(prefix + std::to_string(r), opts.connect_timeout));
      if (!record || record->names.size() != count)
        throw error(errc::protocol, "rank " + std::to_string(r) + " published a malformed address record", ctx);
      if (record->provider != provider_)
        throw error(errc::config, "rank " + std::to_string(r) + " uses provider '" + record->provider + "', this rank '" + provider_ + "'", ctx);
      records.push_back(std::move(*record));
    }
    // Every receive is posted with room for this rank's eager size, and a sender sends eagerly up to its own: a
    // peer with a larger one would send messages that do not fit. So every rank holds the same value, or every
    // rank fails here naming each rank's.
    const std::string eager_prefix = opts.prefix + "/" + std::to_string((joined - 1) / size) + "/eager/";
    store.set(eager_prefix + std::to_string(rank), std::to_string(opts.eager_bytes));
    std::string eager_values;
    bool eager_differs = false;
    for (int r = 0; r < size; ++r) {
      const std::string v = store.get(eager_prefix + std::to_string(r), opts.connect_timeout);
      eager_differs = eager_differs || v != std::to_string(opts.eager_bytes);
      eager_values += (r ? ", rank " : "rank ") + std::to_string(r) + " has " + v;
    }
    if (eager_differs)
      throw error(errc::config, "SHARDKIT_FABRIC_EAGER (fabric_options::eager_bytes) differs between ranks: " + eager_values +
                                    "; every rank must use the same value", ctx);
    // One insert per address (their lengths may differ); FI_AV_TABLE hands out indices in insertion order, and
    // addrs_ holds every rank's matching endpoint, then every bulk endpoint, then every control endpoint.
    addrs_.resize(count * std::size_t(size));
    for (std::size_t e = 0; e < count; ++e)
      for (int r = 0; r < size; ++r) {
        const std::string& name = records[std::size_t(r)].names[e];
        const int rc = fi_av_insert(av_.get(), name.data(), 1, &addrs_[e * std::size_t(size) + std::size_t(r)], 0, nullptr);
        if (rc != 1) fail("fi_av_insert", rc < 0 ? rc : -FI_EOTHER, {.rank = rank, .peer = r, .operation = "fabric.create"});
      }
  }

  const fi_info& info() const noexcept { return *info_; }
  const std::string& provider() const noexcept { return provider_; }
  fid_domain* domain() const noexcept { return domain_.get(); }
  fid_cq* cq() const noexcept { return cq_.get(); }
  fid_ep* ep(endpoint_role e) const noexcept { return eps_[std::size_t(e)].get(); }
  fi_addr_t addr(endpoint_role e, int rank) const noexcept { return addrs_[std::size_t(e) * std::size_t(size_) + std::size_t(rank)]; }

  //! Closes the endpoints: every posted operation ends, so no buffer is written afterwards. The domain stays
  //! open for the owner to close its memory registrations.
  void close_endpoints() noexcept {
    for (auto& ep : eps_) ep.reset();
  }

 private:
  fid_ptr<fid_ep> open_endpoint(const error_context& ctx) {
    fid_ep* raw = nullptr;
    check("fi_endpoint", fi_endpoint(domain_.get(), info_.get(), &raw, nullptr), ctx);
    fid_ptr<fid_ep> ep(raw);
    if (shm_) {
      const std::string name = new_shm_endpoint_name();
      check("fi_setname", fi_setname(&ep->fid, const_cast<char*>(name.c_str()), name.size() + 1), ctx);
    }
    check("fi_ep_bind(cq)", fi_ep_bind(ep.get(), &cq_->fid, FI_TRANSMIT | FI_RECV), ctx);
    check("fi_ep_bind(av)", fi_ep_bind(ep.get(), &av_->fid, 0), ctx);
    check("fi_enable", fi_enable(ep.get()), ctx);
    return ep;
  }
  static std::string name_of(fid_ep* ep, const error_context& ctx) {
    std::string name(256, '\0');
    std::size_t len = name.size();
    check("fi_getname", fi_getname(&ep->fid, name.data(), &len), ctx);
    name.resize(len);
    return name;
  }

  int size_;
  std::string provider_;
  bool shm_ = false;
  info_ptr info_;
  fid_ptr<fid_fabric> fabric_;
  fid_ptr<fid_domain> domain_;
  fid_ptr<fid_cq> cq_;
  fid_ptr<fid_av> av_;
  std::array<fid_ptr<fid_ep>, count> eps_;  // declared last among the fids: closed first
  std::vector<fi_addr_t> addrs_;
};

}  // namespace shardkit::transport::detail::fabric
