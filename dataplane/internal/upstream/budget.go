package upstream

import (
	"sync"
	"time"
)

// Retry budget defaults (Envoy's retry budget, on rates): over a sliding
// window, the retries of a pool (model group) add at most
// DefaultRetryBudgetRatio of its requests, and at least
// DefaultRetryBudgetMin retries are always allowed per window (so a quiet
// pool can still retry, and a proxy that just started, with no request
// history, can find out a brownout: each faulty deployment costs a retry
// or two in its first requests, before the ratio of its requests covers
// them; Linkerd's and Finagle's minimum is 10 a second).
const (
	DefaultRetryBudgetRatio = 0.2
	DefaultRetryBudgetMin   = 10
	RetryBudgetWindow       = 10 * time.Second
	budgetBuckets           = 10
)

// RetryBudget bounds the retries of every pool. Safe for concurrent use.
type RetryBudget struct {
	ratio float64
	min   int64
	mu    sync.Mutex
	pools map[string]*poolBudget
}

type poolBudget struct {
	// One bucket per second of the window, by unix second modulo
	// budgetBuckets.
	sec      [budgetBuckets]int64
	requests [budgetBuckets]int64
	retries  [budgetBuckets]int64
}

// NewRetryBudget returns a budget of ratio (0 < ratio ≤ 1) with min retries
// always allowed per window.
func NewRetryBudget(ratio float64, min int64) *RetryBudget {
	return &RetryBudget{ratio: ratio, min: min, pools: map[string]*poolBudget{}}
}

func (b *RetryBudget) pool(name string) *poolBudget {
	p := b.pools[name]
	if p == nil {
		p = &poolBudget{}
		b.pools[name] = p
	}
	return p
}

// bucket returns the index of now's bucket, resetting it when it last
// held an older second.
func (p *poolBudget) bucket(now time.Time) int {
	s := now.Unix()
	i := int(s % budgetBuckets)
	if p.sec[i] != s {
		p.sec[i], p.requests[i], p.retries[i] = s, 0, 0
	}
	return i
}

func (p *poolBudget) sums(now time.Time) (requests, retries int64) {
	s := now.Unix()
	for i := range budgetBuckets {
		if s-p.sec[i] < budgetBuckets {
			requests += p.requests[i]
			retries += p.retries[i]
		}
	}
	return requests, retries
}

// Request counts a request of pool.
func (b *RetryBudget) Request(pool string, now time.Time) {
	b.mu.Lock()
	p := b.pool(pool)
	p.requests[p.bucket(now)]++
	b.mu.Unlock()
}

// TryRetry takes a retry from pool's budget: false when the pool's retries
// in the window already reach the ratio of its requests (and the minimum).
func (b *RetryBudget) TryRetry(pool string, now time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	p := b.pool(pool)
	i := p.bucket(now)
	req, ret := p.sums(now)
	if float64(ret+1) > max(b.ratio*float64(req), float64(b.min)) {
		return false
	}
	p.retries[i]++
	return true
}

// Spent reports whether pool's budget has no room for another retry now
// (what TryRetry would answer, without taking one).
func (b *RetryBudget) Spent(pool string, now time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	req, ret := b.pool(pool).sums(now)
	return float64(ret+1) > max(b.ratio*float64(req), float64(b.min))
}

// PushbackMin is the minimum of the budget clients are held to: once a
// pool's retries in the window pass max(ratio × requests, PushbackMin)
// (or its own minimum, if lower), answers tell clients not to retry
// (Pushback), though the proxy may still retry on its minimum: that
// allowance is for finding out a brownout at a cold start, and clients
// retrying on top of it would multiply the brownout.
const PushbackMin = 3

// Pushback reports whether pool's retries in the window pass what
// clients may add to: max(ratio × requests, min(its minimum,
// PushbackMin)).
func (b *RetryBudget) Pushback(pool string, now time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	req, ret := b.pool(pool).sums(now)
	return float64(ret+1) > max(b.ratio*float64(req), float64(min(b.min, PushbackMin)))
}

// Use returns pool's requests and retries in the window (metrics).
func (b *RetryBudget) Use(pool string, now time.Time) (requests, retries int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.pool(pool).sums(now)
}
