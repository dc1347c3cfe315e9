// Package admission holds the data plane's per-class admission state
// (SPEC §7 steps 3–4, §7.2; docs/traffic.md): the per-key count of
// interactive requests in flight that behavioural demotion reads, the
// class scopes of a deployment's fleet-wide concurrency lease (reserved
// engine slots), and the metrics of both.
package admission

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicegw/sluice/dataplane/internal/classify"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// InFlight counts each key's interactive requests in flight on this proxy.
// Demotion by in-flight count reads it: the count is per proxy, not
// fleet-wide (docs/traffic.md, "Demotion"): a key whose requests are
// spread over n proxies may hold up to n × the threshold interactive
// requests before every proxy demotes it. Only keys of orgs that demote
// by in-flight count are counted.
type InFlight struct {
	mu sync.Mutex
	n  map[string]int64
}

// Acquire returns the key's count before this request and counts it.
func (f *InFlight) Acquire(key string) int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.n == nil {
		f.n = map[string]int64{}
	}
	c := f.n[key]
	f.n[key] = c + 1
	return c
}

// Peek returns the key's count.
func (f *InFlight) Peek(key string) int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.n[key]
}

// Release uncounts a request Acquire counted.
func (f *InFlight) Release(key string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if c := f.n[key] - 1; c > 0 {
		f.n[key] = c
	} else {
		delete(f.n, key)
	}
}

// Scope ID suffixes of the class scopes of a deployment's lease.
const (
	// SharedSuffix: the slots agent and batch requests share
	// (max_concurrency − interactive_reserve).
	SharedSuffix = "#shared"
	// BatchSuffix: batch_max_concurrency.
	BatchSuffix = "#batch"
)

// DeploymentScopes are the scopes of one fleet-wide lease on deployment d
// (max_concurrency > 0) for a request of class c: the whole engine for
// every class; for agent and batch also the non-reserved share
// (max_concurrency − interactive_reserve, when a reserve is set); for batch
// also its own cap. One admission call checks and takes them all or none,
// and the lease is renewed and released with all of them, so the caps hold
// fleet-wide exactly as max_concurrency does. ok is false when class c may
// not use the deployment at all (a reserve of every slot).
func DeploymentScopes(id string, maxConcurrency int64, t *configv1.DeploymentTraffic, c configv1.TrafficClass) (scopes []limits.Scope, ok bool) {
	scopes = []limits.Scope{{Kind: limits.KindDeployment, ID: id, MaxParallel: maxConcurrency}}
	if c == configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE || !classify.Valid(c) {
		return scopes, true
	}
	if r := t.GetInteractiveReserve(); r > 0 {
		// Validated 0 < reserve ≤ max_concurrency by the admin API; a
		// reserve of the whole engine leaves agents and batch nothing.
		shared := max(maxConcurrency-r, 0)
		if shared == 0 {
			return nil, false
		}
		scopes = append(scopes, limits.Scope{Kind: limits.KindDeployment, ID: id + SharedSuffix, MaxParallel: shared})
	}
	if b := t.GetBatchMaxConcurrency(); b > 0 && c == configv1.TrafficClass_TRAFFIC_CLASS_BATCH {
		scopes = append(scopes, limits.Scope{Kind: limits.KindDeployment, ID: id + BatchSuffix, MaxParallel: b})
	}
	return scopes, true
}

// Metrics are the series of classification.
type Metrics struct {
	Classified *prometheus.CounterVec
}

// NewMetrics registers the metrics on reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{Classified: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sluice_proxy_traffic_class_total",
		Help: "Authenticated requests by the traffic class they were admitted as and the reason (credential, default, rule:<n>, demoted:prompt_tokens, demoted:in_flight).",
	}, []string{"class", "reason"})}
	if err := reg.Register(m.Classified); err != nil {
		return nil, err
	}
	return m, nil
}
