package limits

import (
	"errors"
	"sync"
	"time"
)

// ErrNoFallback reports that a request carries a budget or parallel limit,
// which never fall back to a local limiter: the caller must fail closed.
var ErrNoFallback = errors.New("budget and parallel limits have no local fallback")

// localBuckets is the number of 1 s buckets a local window counts: the
// current second plus the 60 before it, like the Redis window.
const localBuckets = 61

// LocalLimiter is the documented rpm/tpm fallback for when Redis is
// unavailable and the configuration allows it: each data plane enforces its
// local share of every limit (limit ÷ live data planes, at least 1) over the
// same sliding 60 s window, in process. It never admits budget or parallel
// limited requests (ErrNoFallback). It is safe for concurrent use.
type LocalLimiter struct {
	planes func() int
	now    func() time.Time

	mu    sync.Mutex
	win   map[string]*localWindow
	calls int
}

// localWindow is a ring of per-second counts; sec records which second each
// slot holds, so stale slots read as 0.
type localWindow struct {
	count [localBuckets]int64
	sec   [localBuckets]int64
}

func (w *localWindow) total(now int64) int64 {
	var t int64
	for i := range w.count {
		if w.sec[i] > now-localBuckets {
			t += w.count[i]
		}
	}
	return t
}

func (w *localWindow) add(now, n int64) {
	i := now % localBuckets
	if w.sec[i] != now {
		w.sec[i], w.count[i] = now, 0
	}
	w.count[i] = max(w.count[i]+n, 0)
}

// NewLocalLimiter returns a LocalLimiter; planes reports the live data
// planes in the region (from the fleet view), at least 1.
func NewLocalLimiter(planes func() int) *LocalLimiter {
	return &LocalLimiter{planes: planes, now: time.Now, win: make(map[string]*localWindow)}
}

func (l *LocalLimiter) share(limit int64) int64 {
	p := int64(max(l.planes(), 1))
	return max(limit/p, 1)
}

func (l *LocalLimiter) window(org string, s *Scope, typ LimitType) *localWindow {
	k := org + "\x00" + s.Kind + "\x00" + s.ID + "\x00" + string(typ)
	w := l.win[k]
	if w == nil {
		w = &localWindow{}
		l.win[k] = w
	}
	return w
}

// Admit checks the local share of every rpm/tpm limit of req and, only if
// all pass, counts the request. Requests with a budget or parallel limit
// return ErrNoFallback. The decision has no Lease; call Reconcile with the
// real token usage instead of Settle.
func (l *LocalLimiter) Admit(req Request) (Decision, error) {
	if _, err := validate(&req); err != nil {
		return Decision{}, err
	}
	for _, s := range req.Scopes {
		if s.Budget != nil || s.MaxParallel > 0 {
			return Decision{}, ErrNoFallback
		}
	}
	now := l.now().Unix()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sweep(now)
	var d Decision
	for i := range req.Scopes {
		s := &req.Scopes[i]
		for _, c := range []struct {
			typ   LimitType
			limit int64
			cost  int64
		}{{LimitRPM, s.RPM, 1}, {LimitTPM, s.TPM, req.EstTokens}} {
			if c.limit <= 0 {
				continue
			}
			share := l.share(c.limit)
			if l.window(req.OrgID, s, c.typ).total(now)+c.cost > share {
				d.Rejection = &Rejection{
					Scope: ScopeRef{Kind: s.Kind, ID: s.ID}, Limit: c.typ,
					RetryAfter: time.Second, Never: c.cost > share,
				}
				if d.Rejection.Never {
					d.Rejection.RetryAfter = DefaultRateWindow
				}
				return d, nil
			}
		}
	}
	for i := range req.Scopes {
		s := &req.Scopes[i]
		if s.RPM > 0 {
			l.window(req.OrgID, s, LimitRPM).add(now, 1)
		}
		if s.TPM > 0 {
			l.window(req.OrgID, s, LimitTPM).add(now, req.EstTokens)
		}
	}
	d.Allowed = true
	return d, nil
}

// Reconcile adds actual − estimated tokens of an admitted request to its
// local tpm windows (in the current second).
func (l *LocalLimiter) Reconcile(req Request, actualTokens int64) {
	now := l.now().Unix()
	l.mu.Lock()
	defer l.mu.Unlock()
	for i := range req.Scopes {
		if s := &req.Scopes[i]; s.TPM > 0 {
			l.window(req.OrgID, s, LimitTPM).add(now, actualTokens-req.EstTokens)
		}
	}
}

// sweep drops idle windows every 1024 calls so the map stays bounded by
// the scopes active in the last minute. l.mu is held.
func (l *LocalLimiter) sweep(now int64) {
	l.calls++
	if l.calls%1024 != 0 {
		return
	}
	for k, w := range l.win {
		if w.total(now) == 0 {
			delete(l.win, k)
		}
	}
}
