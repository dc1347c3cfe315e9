package limits

import (
	"context"
	"runtime"
	"sync"
	"time"
)

// The settlement worker. Settlements are queued by the request path and
// settled by one long-lived component (Settler.Run) in batches: one round
// trip, and one script call per org, for many requests. A failed one is
// retried on its own with backoff, for up to SettleGiveUp; settling is
// idempotent by request id, so retries are safe.

const (
	// SettleGiveUp bounds the retries of one settlement. Past it the
	// leases have expired anyway (LeaseTTL); the tpm and budget counters
	// keep the admission's estimate and reservation (conservative), and
	// the ledger is unaffected (it is written from usage events).
	SettleGiveUp = 2 * time.Minute
	// settleQueueLen is the queue of the worker; a settlement that finds
	// it full waits in an overflow list the worker takes next (the
	// request path never blocks on it and starts no goroutine).
	settleQueueLen = 8192
	maxSettleBatch = 64
)

// SettleJob is one queued settlement.
type SettleJob struct {
	Item SettleItem
	// Done is called exactly once: with the result, or with the last
	// error when the settlement was given up after SettleGiveUp.
	Done func(res SettleResult, err error)
}

// Settler settles queued settlements until its Run returns.
type Settler struct {
	lim *Limiter
	// callFailed is called for every settle call that failed (limits
	// unavailable; the settlement is retried).
	callFailed func()
	q          chan SettleJob
	wake       chan struct{}
	mu         sync.Mutex
	overflow   []SettleJob
	pending    pendingCount
}

// NewSettler returns a settler of lim; callFailed (may be nil) counts the
// settle calls that failed.
func NewSettler(lim *Limiter, callFailed func()) *Settler {
	if callFailed == nil {
		callFailed = func() {}
	}
	return &Settler{lim: lim, callFailed: callFailed, q: make(chan SettleJob, settleQueueLen), wake: make(chan struct{}, 1)}
}

// Enqueue hands j to the worker without blocking.
func (s *Settler) Enqueue(j SettleJob) {
	s.pending.Add(1)
	select {
	case s.q <- j:
	default:
		s.mu.Lock()
		s.overflow = append(s.overflow, j)
		s.mu.Unlock()
		select {
		case s.wake <- struct{}{}:
		default:
		}
	}
}

// Drain waits until no settlement is pending (queued, being settled or
// retried) or ctx ends. The worker must be running.
func (s *Settler) Drain(ctx context.Context) error { return s.pending.wait(ctx) }

// Run settles queued settlements until ctx ends, then settles what is
// still queued and returns (retries in progress go on until they succeed
// or give up; Drain waits for them).
func (s *Settler) Run(ctx context.Context) error {
	batch := make([]SettleJob, 0, maxSettleBatch)
	for {
		batch = batch[:0]
		select {
		case j := <-s.q:
			batch = append(batch, j)
		case <-s.wake:
		case <-ctx.Done():
			for s.settleQueued(batch[:0]) {
			}
			return nil
		}
		// Let the goroutines that are ready run first: requests finishing
		// now queue their settlements into this batch (one script call per
		// org settles them together).
		runtime.Gosched()
		s.collect(&batch)
		s.settle(batch)
		for len(s.q) > 0 || s.hasOverflow() {
			if !s.settleQueued(batch[:0]) {
				break
			}
		}
	}
}

// settleQueued settles one batch of what is queued; false when nothing was.
func (s *Settler) settleQueued(batch []SettleJob) bool {
	s.collect(&batch)
	if len(batch) == 0 {
		return false
	}
	s.settle(batch)
	return true
}

func (s *Settler) hasOverflow() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.overflow) > 0
}

// collect fills batch (up to maxSettleBatch) from the overflow list, then
// the queue.
func (s *Settler) collect(batch *[]SettleJob) {
	s.mu.Lock()
	if n := min(len(s.overflow), maxSettleBatch-len(*batch)); n > 0 {
		*batch = append(*batch, s.overflow[:n]...)
		s.overflow = append(s.overflow[:0:0], s.overflow[n:]...)
	}
	s.mu.Unlock()
	for len(*batch) < maxSettleBatch {
		select {
		case j := <-s.q:
			*batch = append(*batch, j)
		default:
			return
		}
	}
}

func (s *Settler) settle(batch []SettleJob) {
	if len(batch) == 0 {
		return
	}
	items := make([]SettleItem, len(batch))
	for i, j := range batch {
		items[i] = j.Item
	}
	res, errs := s.lim.SettleBatch(context.Background(), items)
	for i, j := range batch {
		if errs[i] != nil {
			s.callFailed()
			go s.retry(j)
			continue
		}
		s.finish(j, res[i], nil)
	}
}

func (s *Settler) finish(j SettleJob, res SettleResult, err error) {
	if j.Done != nil {
		j.Done(res, err)
	}
	s.pending.Done()
}

// retry settles j on its own, retrying with backoff for up to
// SettleGiveUp.
func (s *Settler) retry(j SettleJob) {
	deadline := time.Now().Add(SettleGiveUp)
	backoff := 20 * time.Millisecond
	time.Sleep(backoff)
	for {
		res, err := s.lim.SettleOne(context.Background(), j.Item)
		if err == nil {
			s.finish(j, res, nil)
			return
		}
		s.callFailed()
		if time.Now().After(deadline) {
			s.finish(j, SettleResult{}, err)
			return
		}
		time.Sleep(backoff)
		backoff = min(backoff*2, 2*time.Second)
	}
}

// pendingCount counts pending settlements. Unlike a sync.WaitGroup it may
// grow while someone waits (a request finishing during Drain): wait
// returns the first time the count is zero.
type pendingCount struct {
	mu   sync.Mutex
	n    int
	zero chan struct{} // closed when n reaches 0; nil while n is 0
}

func (p *pendingCount) Add(d int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n == 0 && d > 0 {
		p.zero = make(chan struct{})
	}
	p.n += d
	if p.n == 0 && p.zero != nil {
		close(p.zero)
		p.zero = nil
	}
}

func (p *pendingCount) Done() { p.Add(-1) }

func (p *pendingCount) wait(ctx context.Context) error {
	p.mu.Lock()
	z := p.zero
	p.mu.Unlock()
	if z == nil {
		return nil
	}
	select {
	case <-z:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
