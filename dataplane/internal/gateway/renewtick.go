package gateway

import (
	"context"
	"sync"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/limits"
)

// The shared renewal tick (issue 15). Every live request's leases are
// renewed every renew interval; instead of a timer per request, one
// goroutine per handler ticks every quarter renew interval and renews,
// in one batch (limits.RenewBatch: one renew.lua call per org, the orgs'
// calls in one pipelined round trip), every
// request due within half a tick. A request is thus renewed every
// interval ± an eighth of it, never later than the abort rule allows (a
// request whose renewals all failed for LeaseTTL − RenewInterval is
// stopped, as before). The goroutine runs only while some request is
// registered: it starts with the first and ends at the second tick that
// finds none (so a data plane serving one request at a time does not
// start a goroutine and a ticker per request).

// renewTicksPerInterval is how many ticks one renew interval holds.
const renewTicksPerInterval = 4

// renewTick holds the requests whose leases are renewed.
type renewTick struct {
	mu sync.Mutex
	// set lists the registered requests: a ring through renewal.prev and
	// next around head (O(1) to add and remove, no hashing on the request
	// path); n counts them.
	head    renewal
	n       int
	running bool
	wake    chan struct{}
	// batches and renewed count the batches renewed and the requests in
	// them (tests).
	batches, renewed int
}

// add registers r, first due one renew interval from now, and starts the
// tick's goroutine if it is not running.
func (t *renewTick) add(r *renewal, lim *limits.Limiter) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.wake == nil {
		t.wake = make(chan struct{}, 1)
		t.head.prev, t.head.next = &t.head, &t.head
	}
	r.due = time.Now().Add(lim.RenewInterval())
	t.link(r)
	if !t.running {
		t.running = true
		go t.run(lim)
	}
}

// remove stops r's renewals (a renewal in progress finishes).
func (t *renewTick) remove(r *renewal) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r.stopped = true
	t.unlink(r)
}

// link adds r to the set; t.mu held.
func (t *renewTick) link(r *renewal) {
	r.prev, r.next = t.head.prev, &t.head
	t.head.prev.next = r
	t.head.prev = r
	t.n++
}

// unlink takes r out of the set if it is in; t.mu held.
func (t *renewTick) unlink(r *renewal) {
	if r.next == nil {
		return
	}
	r.prev.next, r.next.prev = r.next, r.prev
	r.prev, r.next = nil, nil
	t.n--
}

// kick makes r due now: it is renewed at once, or right after the batch
// in progress.
func (t *renewTick) kick(r *renewal) {
	t.mu.Lock()
	if r.stopped {
		t.mu.Unlock()
		return
	}
	r.kicked = true
	t.mu.Unlock()
	select {
	case t.wake <- struct{}{}:
	default:
	}
}

// registered returns the number of requests renewed (tests).
func (t *renewTick) registered() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.n
}

func (t *renewTick) run(lim *limits.Limiter) {
	interval := lim.RenewInterval()
	tick := interval / renewTicksPerInterval
	tk := time.NewTicker(tick)
	defer tk.Stop()
	empty := 0 // ticks in a row that found no request
	for {
		t.mu.Lock()
		if t.n == 0 {
			if empty++; empty > 1 {
				t.running = false
				t.mu.Unlock()
				return
			}
		} else {
			empty = 0
		}
		horizon := time.Now().Add(tick / 2)
		var due []*renewal
		for r := t.head.next; r != &t.head; r = r.next {
			if r.kicked || !r.due.After(horizon) {
				r.kicked = false
				due = append(due, r)
			}
		}
		t.mu.Unlock()
		if len(due) > 0 {
			t.renew(lim, due, interval)
		}
		t.mu.Lock()
		again := false
		for r := t.head.next; r != &t.head; r = r.next {
			again = again || r.kicked
		}
		t.mu.Unlock()
		if again {
			continue
		}
		select {
		case <-tk.C:
		case <-t.wake:
		}
	}
}

// renew renews the leases of due in one batch and schedules their next
// renewal (or drops the requests it aborted).
func (t *renewTick) renew(lim *limits.Limiter, due []*renewal, interval time.Duration) {
	var items []limits.RenewItem
	spans := make([][2]int, len(due))
	now := time.Now()
	for i, r := range due {
		x := r.x
		spans[i][0] = len(items)
		for _, l := range x.leases.snapshot() {
			it := limits.RenewItem{Lease: l}
			if l == x.lease && l.Sweepable() {
				rep := x.report(now)
				it.Report = &rep
			}
			items = append(items, it)
		}
		spans[i][1] = len(items)
	}
	t.mu.Lock()
	t.batches++
	t.renewed += len(due)
	t.mu.Unlock()
	states, errs := lim.RenewBatch(context.Background(), items)
	ttl := lim.LeaseTTL()
	for i, r := range due {
		lo, hi := spans[i][0], spans[i][1]
		leases := make([]*limits.Lease, 0, hi-lo)
		for _, it := range items[lo:hi] {
			leases = append(leases, it.Lease)
		}
		live := r.renewed(leases, states[lo:hi], errs[lo:hi], interval, ttl)
		t.mu.Lock()
		if live {
			r.due = time.Now().Add(interval)
		} else {
			r.stopped = true
			t.unlink(r)
		}
		t.mu.Unlock()
	}
}
