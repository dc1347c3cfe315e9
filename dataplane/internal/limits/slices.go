package limits

import (
	"context"
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// Quota slices (issue 15; docs/limits.md, "Quota slices").
//
// For a hot scope with large rpm/tpm limits, a data plane holds slices of
// the fleet-wide window, carved in Redis by carve.lua: requests and tokens
// added to one bucket of the scope's window as if admitted there, which the
// data plane then admits locally, without a round trip, until that bucket
// ends (by Redis's clock, measured conservatively from when the carve was
// sent). A unit counted in bucket b stays counted until b leaves the
// window, at least one full window after any use within b, so the window's
// overshoot bound stays zero. What a slice did not use, refunds of token
// estimates and debts of under-estimates are returned by the slice worker
// (RunSlices), in the same carve.lua call that carves the next slices: one
// call per org, for all of its scopes, every SliceConfig.Tick. Carves take
// at most 1/Share of the room left below the limit less its reserve, so
// near the limit slices shrink, then stop, and the scope is admitted
// exactly (admit.lua) again; scopes whose limits are below MinRPM / MinTPM
// never leave exact admission. Budgets and concurrency are always exact:
// a request's rpm/tpm may come from slices while its budget and parallel
// limits go to Redis in the same single admission call.

// Defaults of SliceConfig.
const (
	DefaultSliceMinRPM   = 600
	DefaultSliceMinTPM   = 60_000
	DefaultSliceReserve  = 100 // per mille
	DefaultSliceShare    = 4
	DefaultSliceTick     = 50 * time.Millisecond
	DefaultSliceIdle     = 10 * time.Second
	sliceDeadlineMargin  = 5 * time.Millisecond
	maxSliceItemsPerCall = 128
)

// SliceConfig configures quota slices; the zero value disables them.
type SliceConfig struct {
	// Enabled turns slices on.
	Enabled bool
	// MinRPM and MinTPM: a scope whose rpm (tpm) limit is below is always
	// admitted exactly.
	MinRPM, MinTPM int64
	// Reserve is the part of each limit, per mille, that is never carved:
	// the last requests of a window are admitted exactly.
	Reserve int64
	// Share: one carve takes at most 1/Share of the room left.
	Share int64
	// Tick is the slice worker's period (returns, refills).
	Tick time.Duration
	// Idle: a scope without demand for this long is forgotten.
	Idle time.Duration
}

func (c *SliceConfig) defaults() {
	if c.MinRPM == 0 {
		c.MinRPM = DefaultSliceMinRPM
	}
	if c.MinTPM == 0 {
		c.MinTPM = DefaultSliceMinTPM
	}
	if c.Reserve == 0 {
		c.Reserve = DefaultSliceReserve
	}
	if c.Share == 0 {
		c.Share = DefaultSliceShare
	}
	if c.Tick == 0 {
		c.Tick = DefaultSliceTick
	}
	if c.Idle == 0 {
		c.Idle = DefaultSliceIdle
	}
}

type sliceKey struct{ org, kind, id string }

// slice is one carve held: units left of bucket, usable until deadline.
type slice struct {
	bucket   int64
	deadline time.Time
	r, t     int64
}

// sliceRet is what goes back to one bucket: unused requests and tokens
// (t < 0: a debt to charge).
type sliceRet struct{ r, t int64 }

// sliceScope is the local state of one scope.
type sliceScope struct {
	key  sliceKey
	hkey string

	mu       sync.Mutex
	rpm, tpm int64  // the limits the held slices were carved under
	gen      uint64 // bumped when the limits change
	held     []slice
	rets     map[int64]sliceRet
	usedR    int64 // demand since the last tick (local and exact)
	usedT    int64
	rateR    float64 // demand per second (moving average)
	rateT    float64
	lastUse  time.Time
	inflight bool
	backoff  time.Time // no carve before (the last one got nothing)
	// Header state from the last carve: the fleet's remaining outside the
	// slices and the reset times, as of carvedAt.
	remR, remT     int64
	resetR, resetT time.Duration
	carvedAt       time.Time
}

// sliceTake is the part of a request admitted from a slice of one scope.
type sliceTake struct {
	sc     *sliceScope
	bucket int64
	r, t   int64
	hasTPM bool
}

// slicer holds the slices of one Limiter.
type slicer struct {
	lim *Limiter
	cfg SliceConfig
	mu  sync.RWMutex
	m   map[sliceKey]*sliceScope
	// calls counts the worker's carve.lua calls (tests, benchmarks).
	calls atomic.Int64
	now   func() time.Time
}

func newSlicer(l *Limiter, cfg SliceConfig) *slicer {
	cfg.defaults()
	return &slicer{lim: l, cfg: cfg, m: map[sliceKey]*sliceScope{}, now: time.Now}
}

// eligible reports whether a scope's rate limits may be sliced.
func (s *slicer) eligible(sc *Scope) bool {
	if sc.RPM == 0 && sc.TPM == 0 {
		return false
	}
	return (sc.RPM == 0 || sc.RPM >= s.cfg.MinRPM) && (sc.TPM == 0 || sc.TPM >= s.cfg.MinTPM)
}

func (s *slicer) scope(org string, sc *Scope) *sliceScope {
	k := sliceKey{org, sc.Kind, sc.ID}
	s.mu.RLock()
	st := s.m[k]
	s.mu.RUnlock()
	if st != nil {
		return st
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if st = s.m[k]; st == nil {
		kb := newKeyBuilder(s.lim.cfg.KeyPrefix, org)
		st = &sliceScope{key: k, hkey: kb.scope(sc)[0], rpm: sc.RPM, tpm: sc.TPM, rets: map[int64]sliceRet{}}
		s.m[k] = st
	}
	return st
}

// take admits req's rate limits from slices where it can: it returns the
// takes and the request Redis must still check (rate limits taken locally
// zeroed; nil scopes left out entirely when nothing is left to check).
// headers are the local rate headers of the scopes taken. Scopes that
// could not be taken record their demand, so the worker carves for them.
func (s *slicer) take(req *Request) (takes []sliceTake, rest []Scope, hdr RateHeaders) {
	now := s.now()
	for i := range req.Scopes {
		sc := &req.Scopes[i]
		if !s.eligible(sc) {
			if sc.RPM > 0 || sc.TPM > 0 {
				s.ineligible(req.OrgID, sc)
			}
			continue
		}
		st := s.scope(req.OrgID, sc)
		needT := int64(0)
		if sc.TPM > 0 {
			needT = req.EstTokens
		}
		needR := int64(0)
		if sc.RPM > 0 {
			needR = 1
		}
		st.mu.Lock()
		if st.rpm != sc.RPM || st.tpm != sc.TPM {
			// The limits changed (admin API, snapshot): slices carved
			// under the old ones are returned, none is used again.
			st.revokeLocked()
			st.rpm, st.tpm = sc.RPM, sc.TPM
		}
		st.usedR += needR
		st.usedT += needT
		st.lastUse = now
		ok := false
		for j := range st.held {
			h := &st.held[j]
			if h.deadline.After(now) && h.r >= needR && h.t >= needT {
				h.r -= needR
				h.t -= needT
				takes = append(takes, sliceTake{sc: st, bucket: h.bucket, r: needR, t: needT, hasTPM: sc.TPM > 0})
				ok = true
				break
			}
		}
		if ok {
			st.headersLocked(now, sc, &hdr)
		}
		st.mu.Unlock()
		if ok {
			if rest == nil {
				rest = append(make([]Scope, 0, len(req.Scopes)), req.Scopes...)
			}
			rest[i].RPM, rest[i].TPM = 0, 0
		}
	}
	if rest == nil {
		return nil, req.Scopes, hdr
	}
	out := rest[:0]
	for _, sc := range rest {
		if sc.RPM > 0 || sc.TPM > 0 || sc.MaxParallel > 0 || sc.Budget != nil {
			out = append(out, sc)
		}
	}
	return takes, out, hdr
}

// ineligible revokes the slices of a scope whose limits changed to
// values that are not sliced (below MinRPM / MinTPM): none is used again,
// and the worker stops carving for it.
func (s *slicer) ineligible(org string, sc *Scope) {
	s.mu.RLock()
	st := s.m[sliceKey{org, sc.Kind, sc.ID}]
	s.mu.RUnlock()
	if st == nil {
		return
	}
	st.mu.Lock()
	if st.rpm != sc.RPM || st.tpm != sc.TPM {
		st.revokeLocked()
		st.rpm, st.tpm = sc.RPM, sc.TPM
		st.lastUse = time.Time{}
		st.usedR, st.usedT = 0, 0
	}
	st.mu.Unlock()
}

// headersLocked merges the scope's local view into hdr (least remaining
// of each kind): the fleet's remaining at the last carve plus what this
// data plane's slices still hold.
func (st *sliceScope) headersLocked(now time.Time, sc *Scope, hdr *RateHeaders) {
	var lr, lt int64
	for _, h := range st.held {
		if h.deadline.After(now) {
			lr += h.r
			lt += h.t
		}
	}
	el := now.Sub(st.carvedAt)
	if sc.RPM > 0 {
		rem := min(st.remR+lr, sc.RPM)
		if hdr.LimitRequests == 0 || rem < hdr.RemainingRequests {
			hdr.LimitRequests, hdr.RemainingRequests, hdr.ResetRequests = sc.RPM, rem, max(st.resetR-el, 0)
		}
	}
	if sc.TPM > 0 {
		rem := min(st.remT+lt, sc.TPM)
		if hdr.LimitTokens == 0 || rem < hdr.RemainingTokens {
			hdr.LimitTokens, hdr.RemainingTokens, hdr.ResetTokens = sc.TPM, rem, max(st.resetT-el, 0)
		}
	}
}

// mergeHeaders keeps the least remaining of each kind.
func mergeHeaders(a, b RateHeaders) RateHeaders {
	if b.LimitRequests > 0 && (a.LimitRequests == 0 || b.RemainingRequests < a.RemainingRequests) {
		a.LimitRequests, a.RemainingRequests, a.ResetRequests = b.LimitRequests, b.RemainingRequests, b.ResetRequests
	}
	if b.LimitTokens > 0 && (a.LimitTokens == 0 || b.RemainingTokens < a.RemainingTokens) {
		a.LimitTokens, a.RemainingTokens, a.ResetTokens = b.LimitTokens, b.RemainingTokens, b.ResetTokens
	}
	return a
}

// revokeLocked gives every held slice back (returned by the next carve
// call) and makes replies of carves in flight go back too.
func (st *sliceScope) revokeLocked() {
	for _, h := range st.held {
		st.retLocked(h.bucket, h.r, h.t)
	}
	st.held = st.held[:0]
	st.gen++
}

func (st *sliceScope) retLocked(bucket, r, t int64) {
	if r == 0 && t == 0 {
		return
	}
	x := st.rets[bucket]
	x.r += r
	x.t += t
	st.rets[bucket] = x
}

// giveBack returns r requests and t tokens (t < 0: a debt) of a take:
// into its slice while that is held and usable, else to Redis.
func (s *slicer) giveBack(tk sliceTake, r, t int64) {
	st := tk.sc
	now := s.now()
	st.mu.Lock()
	defer st.mu.Unlock()
	if t >= 0 {
		for j := range st.held {
			h := &st.held[j]
			if h.bucket == tk.bucket && h.deadline.After(now) {
				h.r += r
				h.t += t
				return
			}
		}
	}
	st.retLocked(tk.bucket, r, t)
}

// rollback undoes takes (the rest of the admission rejected or failed).
func (s *slicer) rollback(takes []sliceTake) {
	for _, tk := range takes {
		s.giveBack(tk, tk.r, tk.t)
	}
}

// settle reconciles the local takes of a request: the token estimate is
// replaced by the real count; a cancelled request gives everything back.
func (s *slicer) settle(takes []sliceTake, tokens int64, cancel bool) {
	for _, tk := range takes {
		switch {
		case cancel:
			s.giveBack(tk, tk.r, tk.t)
		case tk.hasTPM:
			if d := tk.t - max(tokens, 0); d != 0 {
				s.giveBack(tk, 0, d)
			}
		}
	}
}

// RunSlices runs the slice worker until ctx ends: every SliceConfig.Tick
// it returns what slices did not use and carves new ones for the scopes
// in demand, one carve.lua call per org. On return, every held slice is
// given back (one last call). It returns at once when slices are off.
func (l *Limiter) RunSlices(ctx context.Context) error {
	s := l.slices
	if s == nil {
		<-ctx.Done()
		return nil
	}
	t := time.NewTicker(s.cfg.Tick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			s.release()
			return nil
		case <-t.C:
			s.tick(ctx, false)
		}
	}
}

// release revokes every slice and returns them (shutdown).
func (s *slicer) release() {
	s.mu.RLock()
	for _, st := range s.m {
		st.mu.Lock()
		st.revokeLocked()
		st.usedR, st.usedT, st.rateR, st.rateT = 0, 0, 0, 0
		st.mu.Unlock()
	}
	s.mu.RUnlock()
	ctx, cancel := context.WithTimeout(context.Background(), 4*s.lim.cfg.CallTimeout)
	defer cancel()
	s.tick(ctx, true)
}

// carveItem is one scope's part of a carve call.
type carveItem struct {
	st           *sliceScope
	gen          uint64
	rpm, tpm     int64
	wantR, wantT int64
	rets         map[int64]sliceRet
	sent         time.Time
}

// tick expires slices, updates demand and sends returns and carves.
func (s *slicer) tick(ctx context.Context, final bool) {
	now := s.now()
	tickSec := s.cfg.Tick.Seconds()
	bucket := s.lim.cfg.rateBucket
	byOrg := map[string][]carveItem{}
	var idle []sliceKey
	s.mu.RLock()
	for k, st := range s.m {
		st.mu.Lock()
		// Expired slices: what they did not use goes back.
		kept := st.held[:0]
		for _, h := range st.held {
			if h.deadline.After(now) {
				kept = append(kept, h)
			} else {
				st.retLocked(h.bucket, h.r, h.t)
			}
		}
		st.held = kept
		const alpha = 0.2
		st.rateR = (1-alpha)*st.rateR + alpha*float64(st.usedR)/tickSec
		st.rateT = (1-alpha)*st.rateT + alpha*float64(st.usedT)/tickSec
		// Hot: demand within the last bucket (an idle scope stops carving
		// at once and gives back what it holds when it expires).
		hot := st.usedR > 0 || st.usedT > 0 || now.Sub(st.lastUse) < bucket
		st.usedR, st.usedT = 0, 0
		it := carveItem{st: st, gen: st.gen, rpm: st.rpm, tpm: st.tpm, sent: now}
		if hot && !final && !st.inflight && !now.Before(st.backoff) {
			// Enough for the life of a slice (up to 1.5 buckets) at the
			// recent rate, with headroom.
			horizon := 2 * bucket.Seconds()
			if st.rpm > 0 {
				it.wantR = int64(math.Ceil(st.rateR*horizon)) + 1
			}
			if st.tpm > 0 {
				it.wantT = int64(math.Ceil(st.rateT*horizon)) + 1
			}
			if !st.needsCarveLocked(now, it.wantR, it.wantT, bucket) {
				it.wantR, it.wantT = 0, 0
			}
		}
		if len(st.rets) > 0 {
			it.rets = st.rets
			st.rets = map[int64]sliceRet{}
		}
		if it.wantR > 0 || it.wantT > 0 || it.rets != nil {
			st.inflight = true
			byOrg[k.org] = append(byOrg[k.org], it)
		} else if !hot && len(st.held) == 0 && now.Sub(st.lastUse) > s.cfg.Idle {
			idle = append(idle, k)
		}
		st.mu.Unlock()
	}
	s.mu.RUnlock()
	if len(idle) > 0 {
		s.mu.Lock()
		for _, k := range idle {
			if st := s.m[k]; st != nil {
				st.mu.Lock()
				if len(st.held) == 0 && len(st.rets) == 0 && !st.inflight && s.now().Sub(st.lastUse) > s.cfg.Idle {
					delete(s.m, k)
				}
				st.mu.Unlock()
			}
		}
		s.mu.Unlock()
	}
	if len(byOrg) > 0 {
		s.carve(ctx, byOrg)
	}
}

// needsCarveLocked reports whether the scope should carve now: no usable
// slice, or the ones held are low or end within half a bucket.
func (st *sliceScope) needsCarveLocked(now time.Time, wantR, wantT int64, bucket time.Duration) bool {
	var r, t int64
	var last time.Time
	for _, h := range st.held {
		r += h.r
		t += h.t
		if h.deadline.After(last) {
			last = h.deadline
		}
	}
	if len(st.held) == 0 || last.Sub(now) < bucket/2 {
		return true
	}
	return (st.rpm > 0 && r < wantR/2) || (st.tpm > 0 && t < wantT/2)
}

// carve sends one carve.lua call per org (pipelined) and applies the
// replies.
func (s *slicer) carve(ctx context.Context, byOrg map[string][]carveItem) {
	var calls []scriptCall
	var groups [][]carveItem
	for org, items := range byOrg {
		for len(items) > 0 {
			n := min(len(items), maxSliceItemsPerCall)
			calls = append(calls, s.carveCall(org, items[:n]))
			groups = append(groups, items[:n])
			items = items[n:]
		}
	}
	n := 0
	for _, g := range groups {
		n += len(g)
	}
	cctx, cancel := context.WithTimeout(ctx, s.lim.cfg.CallTimeout*time.Duration(1+n/32))
	defer cancel()
	sent := s.now()
	s.calls.Add(int64(len(calls)))
	vals, errs := s.lim.store.evalBatch(cctx, carveScript, calls)
	for _, c := range calls {
		c.args.release()
	}
	for g, items := range groups {
		v := vals[g]
		if errs[g] != nil || len(v) != 1+8*len(items) {
			// Nothing is known to be carved; the returns are kept for
			// the next call (a return applied twice would free units
			// in use, so a call that may have run is not retried:
			// its returns are dropped, which only under-admits).
			for _, it := range items {
				it.st.mu.Lock()
				it.st.inflight = false
				it.st.backoff = sent.Add(s.cfg.Tick * 4)
				it.st.mu.Unlock()
			}
			continue
		}
		for j, it := range items {
			o := v[1+8*j : 9+8*j]
			st := it.st
			st.mu.Lock()
			st.inflight = false
			gr, gt, b, life := o[0], o[1], o[2], time.Duration(o[3])*time.Millisecond
			if gr > 0 || gt > 0 {
				if st.gen != it.gen {
					// Revoked while in flight: straight back.
					st.retLocked(b, gr, gt)
				} else {
					st.addLocked(slice{bucket: b, deadline: it.sent.Add(life - sliceDeadlineMargin), r: gr, t: gt})
				}
			} else if it.wantR > 0 || it.wantT > 0 {
				// Near the limit (or below the reserve): exact admission
				// until the window has room again.
				st.backoff = sent.Add(s.lim.cfg.rateBucket / 2)
			}
			if st.gen == it.gen {
				st.remR, st.resetR = o[4], time.Duration(o[5])*time.Millisecond
				st.remT, st.resetT = o[6], time.Duration(o[7])*time.Millisecond
				st.carvedAt = sent
			}
			st.mu.Unlock()
		}
	}
}

// addLocked adds a carved slice, merged with a held one of its bucket.
func (st *sliceScope) addLocked(x slice) {
	for j := range st.held {
		if st.held[j].bucket == x.bucket {
			st.held[j].r += x.r
			st.held[j].t += x.t
			if x.deadline.Before(st.held[j].deadline) {
				st.held[j].deadline = x.deadline
			}
			return
		}
	}
	st.held = append(st.held, x)
}

// carveCall builds the carve.lua call of items (one org).
func (s *slicer) carveCall(org string, items []carveItem) scriptCall {
	kb := newKeyBuilder(s.lim.cfg.KeyPrefix, org)
	keys := make([]string, 0, 1+len(items))
	keys = append(keys, kb.epoch())
	args := newArgv()
	args.int(ms(s.lim.cfg.rateWindow))
	args.int(ms(s.lim.cfg.rateBucket))
	args.int(int64(len(items)))
	args.int(s.cfg.Reserve)
	args.int(s.cfg.Share)
	for _, it := range items {
		keys = append(keys, it.st.hkey)
		args.int(it.rpm)
		args.int(it.tpm)
		args.int(it.wantR)
		args.int(it.wantT)
		args.int(int64(len(it.rets)))
		for b, x := range it.rets {
			args.int(b)
			args.int(x.r)
			args.int(x.t)
		}
	}
	return scriptCall{keys: keys, args: args}
}

// SliceStats is what a limiter's slices hold (tests, metrics).
type SliceStats struct {
	Scopes         int
	HeldR, HeldT   int64
	PendingReturns int
	// Calls counts the slice worker's carve.lua calls so far.
	Calls int64
}

// SliceStats sums the slices held now.
func (l *Limiter) SliceStats() SliceStats {
	var out SliceStats
	s := l.slices
	if s == nil {
		return out
	}
	now := s.now()
	out.Calls = s.calls.Load()
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, st := range s.m {
		st.mu.Lock()
		out.Scopes++
		for _, h := range st.held {
			if h.deadline.After(now) {
				out.HeldR += h.r
				out.HeldT += h.t
			}
		}
		out.PendingReturns += len(st.rets)
		st.mu.Unlock()
	}
	return out
}
