package limits

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
)

// Sweeping (lease.go describes the layout). A sweep pass is, per org:
// one ZRANGE BYSCORE of the org's lease index for entries whose expiry
// has passed (all orgs pipelined), one MGET of the candidates' records,
// and one settle.lua call in sweep mode, which settles only the requests
// whose entry is still expired and whose record is not settled when it
// runs. Scripts run one at a time, so of two sweepers (or a sweeper and a
// late renewal or settlement) racing for one request exactly one wins:
// the first sweep leaves the tombstone "swept", after which the other
// sweep, a renewal (RenewSwept) and a settlement (SettleResult.Swept) are
// no-ops. Every key of one org's calls carries the org's hash tag.

// Sweep bounds.
const (
	// sweepScanChunk is how many orgs' indexes one pipelined round trip
	// scans.
	sweepScanChunk = 256
	// DefaultSweepLimit bounds the requests one Sweep call settles.
	DefaultSweepLimit = 256
)

// Swept is a request a sweep settled after its lease expired unsettled:
// its reservation was replaced by its last report.
type Swept struct {
	OrgID, RequestID string
	// Tokens and CostMicros are what was charged: the last report.
	Tokens, CostMicros int64
	// Event is the report's usage event (nil when the request reported
	// none).
	Event []byte
	// Alerts are the budget thresholds the settlement crossed.
	Alerts []BudgetAlert
}

// SweepInterval is how often a data plane should Sweep: a quarter of the
// lease TTL, so a lost proxy's requests are settled within 1.25 lease TTLs
// of its last renewal.
func (l *Limiter) SweepInterval() time.Duration { return l.cfg.LeaseTTL / 4 }

// Sweep settles, in the given orgs, up to limit requests whose lease
// expired unsettled (their proxy died or could not renew for a whole
// lease TTL), each with its last report, and returns them; the caller
// publishes their usage events. Orgs that are not valid hash-tag parts are
// skipped. An error (ErrUnavailable) may come with the requests that were
// swept before it; the rest are found again by the next sweep.
func (l *Limiter) Sweep(ctx context.Context, orgIDs []string, limit int) ([]Swept, error) {
	ss, ok := l.store.(sweepStore)
	if !ok {
		return nil, fmt.Errorf("%w: the limits store cannot sweep", ErrInvalidRequest)
	}
	if limit <= 0 {
		limit = DefaultSweepLimit
	}
	now := time.Now().UnixMilli()
	type cand struct {
		org string
		ids []string
	}
	var cands []cand
	var errs []error
	total := 0
	for start := 0; start < len(orgIDs) && total < limit; start += sweepScanChunk {
		chunk := orgIDs[start:min(start+sweepScanChunk, len(orgIDs))]
		orgs := make([]string, 0, len(chunk))
		keys := make([]string, 0, len(chunk))
		for _, o := range chunk {
			if validTagPart(o) {
				orgs = append(orgs, o)
				keys = append(keys, newKeyBuilder(l.cfg.KeyPrefix, o).leaseIndex())
			}
		}
		cctx, cancel := context.WithTimeout(ctx, l.cfg.CallTimeout*time.Duration(1+len(keys)/64))
		ids, es := ss.expired(cctx, keys, now, min(maxSettleGroup, limit))
		cancel()
		for i, org := range orgs {
			if es[i] != nil {
				errs = append(errs, fmt.Errorf("scan org %s: %w", org, es[i]))
				continue
			}
			if n := min(len(ids[i]), limit-total); n > 0 {
				cands = append(cands, cand{org: org, ids: ids[i][:n]})
				total += n
			}
		}
	}
	if len(cands) == 0 {
		return nil, sweepErr(errs)
	}

	groups := make([][]string, len(cands))
	for i, c := range cands {
		kb := newKeyBuilder(l.cfg.KeyPrefix, c.org)
		for _, id := range c.ids {
			groups[i] = append(groups[i], kb.record(id))
		}
	}
	cctx, cancel := context.WithTimeout(ctx, l.cfg.CallTimeout*time.Duration(1+total/64))
	recs, es := ss.mget(cctx, groups)
	cancel()

	// One settle.lua call per org, in sweep mode.
	type group struct {
		org   string
		items []SettleItem
		reps  []*sweptReport
	}
	var gs []group
	for i, c := range cands {
		if es[i] != nil {
			errs = append(errs, fmt.Errorf("read records of org %s: %w", c.org, es[i]))
			continue
		}
		kb := newKeyBuilder(l.cfg.KeyPrefix, c.org)
		g := group{org: c.org}
		for j, id := range c.ids {
			rep, err := parseSweptRecord(recs[i][j])
			if err != nil {
				errs = append(errs, fmt.Errorf("request %s of org %s: %w", id, c.org, err))
				continue
			}
			lease := &Lease{orgID: c.org, requestID: id, needs: true}
			if rep != nil {
				lease.scopes = rep.scopes
			}
			lease.keys = kb.callKeys(id, lease.scopes)
			g.items = append(g.items, SettleItem{Lease: lease})
			g.reps = append(g.reps, rep)
		}
		if len(g.items) > 0 {
			gs = append(gs, g)
		}
	}
	if len(gs) == 0 {
		return nil, sweepErr(errs)
	}
	calls := make([]scriptCall, len(gs))
	n := 0
	for i, g := range gs {
		idx := make([]int, len(g.items))
		for j := range idx {
			idx[j] = j
		}
		calls[i] = l.settleCall(g.items, idx, true)
		n += len(g.items)
	}
	cctx, cancel = context.WithTimeout(ctx, l.cfg.CallTimeout*time.Duration(1+n/16))
	vals, verrs := l.store.evalBatch(cctx, settleScript, calls)
	cancel()
	for _, c := range calls {
		c.args.release()
	}
	var out []Swept
	for i, g := range gs {
		err := verrs[i]
		var res []SettleResult
		if err == nil {
			idx := make([]int, len(g.items))
			for j := range idx {
				idx[j] = j
			}
			res, err = settleResults(g.items, idx, vals[i])
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("sweep org %s: %w", g.org, err))
			continue
		}
		for j, r := range res {
			if !r.Applied {
				continue
			}
			rep := g.reps[j]
			out = append(out, Swept{OrgID: g.org, RequestID: g.items[j].Lease.requestID,
				Tokens: rep.tokens, CostMicros: rep.cost, Event: rep.event, Alerts: r.Alerts})
		}
	}
	return out, sweepErr(errs)
}

// ReclaimBudgetLeases reclaims, in the given orgs, the budget leases of
// quota slices that expired (their data plane died, or lost Redis for a
// whole lease TTL): what each held above its watermark goes back to its
// budget window, as the next carve or exact admission of the scope would
// do (carve.lua, admit.lua), so a scope no live data plane calls for gets
// it back too. Expired rate leases (a bucket ended a bucket ago and its
// data plane did not give back what it held) are reclaimed the same way:
// what each held above its watermarks goes back to its bucket. A sweeper runs it with every pass: one pipelined ZRANGE
// BYSCORE of the orgs' budget-lease indexes, then one reclaim.lua call per
// org with expired leases (up to limit scopes each). It returns the
// micro-USD reclaimed.
func (l *Limiter) ReclaimBudgetLeases(ctx context.Context, orgIDs []string, limit int) (int64, error) {
	ss, ok := l.store.(sweepStore)
	if !ok {
		return 0, fmt.Errorf("%w: the limits store cannot sweep", ErrInvalidRequest)
	}
	if limit <= 0 {
		limit = DefaultSweepLimit
	}
	now := time.Now().UnixMilli()
	var errs []error
	var calls []scriptCall
	var corgs []string
	for start := 0; start < len(orgIDs); start += sweepScanChunk {
		chunk := orgIDs[start:min(start+sweepScanChunk, len(orgIDs))]
		orgs := make([]string, 0, len(chunk))
		keys := make([]string, 0, len(chunk))
		for _, o := range chunk {
			if validTagPart(o) {
				orgs = append(orgs, o)
				keys = append(keys, newKeyBuilder(l.cfg.KeyPrefix, o).budgetLeaseIndex())
			}
		}
		cctx, cancel := context.WithTimeout(ctx, l.cfg.CallTimeout*time.Duration(1+len(keys)/64))
		hks, es := ss.expired(cctx, keys, now, limit)
		cancel()
		for i, org := range orgs {
			if es[i] != nil {
				errs = append(errs, fmt.Errorf("scan budget leases of org %s: %w", org, es[i]))
				continue
			}
			base := newKeyBuilder(l.cfg.KeyPrefix, org).base + "lim:"
			ck := []string{keys[i]}
			for _, hk := range hks[i] {
				if strings.HasPrefix(hk, base) { // only the org's scope states
					ck = append(ck, hk)
				}
			}
			if len(ck) == 1 {
				continue
			}
			args := newArgv()
			args.int(ms(l.cfg.LeaseTTL))
			args.int(ms(l.cfg.rateBucket))
			args.int(ms(l.cfg.rateWindow))
			calls = append(calls, scriptCall{keys: ck, args: args})
			corgs = append(corgs, org)
		}
	}
	if len(calls) == 0 {
		return 0, sweepErr(errs)
	}
	cctx, cancel := context.WithTimeout(ctx, l.cfg.CallTimeout*time.Duration(1+len(calls)/16))
	vals, verrs := l.store.evalBatch(cctx, reclaimScript, calls)
	cancel()
	var total int64
	for i, c := range calls {
		c.args.release()
		if verrs[i] != nil {
			errs = append(errs, fmt.Errorf("reclaim budget leases of org %s: %w", corgs[i], verrs[i]))
		} else if len(vals[i]) > 0 {
			total += vals[i][0]
		}
	}
	return total, sweepErr(errs)
}

func sweepErr(errs []error) error {
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("limits sweep: %w: %w", ErrUnavailable, errors.Join(errs...))
}

// sweptReport is a record's report, as a sweeper reads it.
type sweptReport struct {
	tokens, cost int64
	scopes       []Scope
	event        []byte
}

// parseSweptRecord reads a record found through the lease index: nil (and
// no error) for a missing or settled record, which the sweep call then
// drops from the index; an error for a record without a well-formed
// report (never written so; left alone).
func parseSweptRecord(raw string) (*sweptReport, error) {
	if raw == "" || raw == "done" || raw == "swept" {
		return nil, nil
	}
	_, rest, ok := strings.Cut(raw, "\n")
	if !ok {
		return nil, errors.New("record without a report")
	}
	usage, rest, ok := strings.Cut(rest, "\n")
	if !ok {
		return nil, errors.New("record report without scopes")
	}
	ts, cs, ok := strings.Cut(usage, " ")
	tokens, err1 := strconv.ParseInt(ts, 10, 64)
	cost, err2 := strconv.ParseInt(cs, 10, 64)
	if !ok || err1 != nil || err2 != nil {
		return nil, fmt.Errorf("record report usage %q", usage)
	}
	scopes, rest, err := decodeSpecPrefix(rest)
	if err != nil {
		return nil, err
	}
	event, ok := strings.CutPrefix(rest, "\n")
	if !ok {
		return nil, errors.New("record report without an event")
	}
	rep := &sweptReport{tokens: tokens, cost: cost, scopes: scopes}
	if event != "" {
		rep.event = []byte(event)
	}
	return rep, nil
}

// sweepStore is what Sweep needs of a store beyond scripts.
type sweepStore interface {
	// expired returns, per key, up to limit members scored at most
	// maxScore (ZRANGE BYSCORE LIMIT), in one round trip.
	expired(ctx context.Context, keys []string, maxScore int64, limit int) ([][]string, []error)
	// mget returns, per group, the values of its keys ("" for a missing
	// key): one MGET per group, in one round trip.
	mget(ctx context.Context, groups [][]string) ([][]string, []error)
}

func (p pipeStore) expired(ctx context.Context, keys []string, maxScore int64, limit int) ([][]string, []error) {
	cmds := make([]redispipe.Cmd, len(keys))
	for i, k := range keys {
		cmds[i] = redispipe.Cmd{Head: []string{"ZRANGE"}, Keys: []string{k},
			Args: []any{"-inf", maxScore, "BYSCORE", "LIMIT", 0, limit}}
	}
	vals, errs := p.c.DoMulti(ctx, cmds)
	out := make([][]string, len(keys))
	for i, v := range vals {
		if errs[i] != nil {
			continue
		}
		if v.Kind != '*' && !v.IsNil() {
			errs[i] = fmt.Errorf("ZRANGE answered kind %q", v.Kind)
			continue
		}
		for _, x := range v.Arr {
			out[i] = append(out[i], x.Str)
		}
	}
	return out, errs
}

func (p pipeStore) mget(ctx context.Context, groups [][]string) ([][]string, []error) {
	cmds := make([]redispipe.Cmd, len(groups))
	for i, g := range groups {
		cmds[i] = redispipe.Cmd{Head: []string{"MGET"}, Keys: g}
	}
	vals, errs := p.c.DoMulti(ctx, cmds)
	out := make([][]string, len(groups))
	for i, v := range vals {
		if errs[i] != nil {
			continue
		}
		if v.Kind != '*' || len(v.Arr) != len(groups[i]) {
			errs[i] = fmt.Errorf("MGET answered %d values for %d keys", len(v.Arr), len(groups[i]))
			continue
		}
		out[i] = make([]string, len(v.Arr))
		for j, x := range v.Arr {
			out[i][j] = x.Str // "" for a nil reply
		}
	}
	return out, errs
}

func (g goRedisStore) pipeliner() (redis.Pipeliner, error) {
	c, ok := g.c.(redis.Cmdable)
	if !ok {
		return nil, errors.New("client cannot run pipelines")
	}
	return c.Pipeline(), nil
}

func (g goRedisStore) expired(ctx context.Context, keys []string, maxScore int64, limit int) ([][]string, []error) {
	out := make([][]string, len(keys))
	errs := make([]error, len(keys))
	pipe, err := g.pipeliner()
	if err != nil {
		for i := range errs {
			errs[i] = err
		}
		return out, errs
	}
	cmds := make([]*redis.StringSliceCmd, len(keys))
	for i, k := range keys {
		cmds[i] = pipe.ZRangeArgs(ctx, redis.ZRangeArgs{Key: k, ByScore: true, Start: "-inf",
			Stop: strconv.FormatInt(maxScore, 10), Count: int64(limit)})
	}
	_, _ = pipe.Exec(ctx)
	for i, c := range cmds {
		out[i], errs[i] = c.Result()
	}
	return out, errs
}

func (g goRedisStore) mget(ctx context.Context, groups [][]string) ([][]string, []error) {
	out := make([][]string, len(groups))
	errs := make([]error, len(groups))
	pipe, err := g.pipeliner()
	if err != nil {
		for i := range errs {
			errs[i] = err
		}
		return out, errs
	}
	cmds := make([]*redis.SliceCmd, len(groups))
	for i, k := range groups {
		cmds[i] = pipe.MGet(ctx, k...)
	}
	_, _ = pipe.Exec(ctx)
	for i, c := range cmds {
		vals, err := c.Result()
		if err != nil {
			errs[i] = err
			continue
		}
		out[i] = make([]string, len(vals))
		for j, v := range vals {
			if s, ok := v.(string); ok {
				out[i][j] = s
			}
		}
	}
	return out, errs
}
