package limits

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/sluicegw/sluice/internal/budget"
)

// Reservations tied to leases (issue 19; docs/limits.md, "Lost proxies").
//
// A request admitted with a Report is sweepable. Its record carries, after
// the admission's own line, the report:
//
//	<tokens> <cost micro-USD>\n<scopes spec>\n<usage event>
//
// and the request joins the org's lease index ({o:<org>}:leases, request
// id scored by lease expiry). Every renewal pushes the index entry forward
// and replaces the report with the usage seen so far. Settling removes the
// entry. An entry whose expiry has passed belongs to a request whose proxy
// stopped renewing (it died): Sweep settles it with its last report, so its
// reservation returns to the budget and its tpm estimate is replaced, and
// hands back its usage event for the caller to publish. The scopes spec
// (encodeSpec) is what a sweeper needs to build the settlement without the
// proxy's Lease.

// Report is what a live request has used so far: what a sweeper charges
// if its proxy dies before settling, and the usage event it then
// publishes.
type Report struct {
	// Tokens and CostMicros are charged by a sweep (replacing the
	// admission's estimate and reservation, like Settle).
	Tokens     int64
	CostMicros int64
	// Event is the usage event to publish for the request if it is swept
	// (opaque here: the proxy's marshaled usagev1.UsageEvent). It must not
	// be modified once passed.
	Event []byte
}

// sweepState is the sweepable part of a Lease: its scopes spec and the
// last report sent (renewals run on one goroutine, but Renew may race
// with a report being replaced).
type sweepState struct {
	spec string
	mu   sync.Mutex
	rep  Report
	// lazy, when set, supplies rep the first time it is needed (a request
	// admitted entirely from slices with a Request.Reporter: its report
	// is usually replaced by a renewal's before any is sent).
	lazy Reporter
}

func newSweepState(scopes []Scope, rep Report) *sweepState {
	return &sweepState{spec: encodeSpec(scopes), rep: rep}
}

// setReport replaces the report.
func (s *sweepState) setReport(rep Report) {
	s.mu.Lock()
	s.rep, s.lazy = rep, nil
	s.mu.Unlock()
}

// appendNote appends the report ARGV of admit.lua and renew.lua: the
// record's report, or "" without one (s nil).
func (s *sweepState) appendNote(a *argv) {
	if s == nil {
		a.str("")
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.lazy != nil {
		s.rep, s.lazy = s.lazy.Report(), nil
	}
	a.note(s.rep, s.spec)
}

// note appends the report (see the top of this file) as one bulk string
// without building it first.
func (a *argv) note(rep Report, spec string) {
	var tb, cb [20]byte
	t := strconv.AppendInt(tb[:0], max(rep.Tokens, 0), 10)
	c := strconv.AppendInt(cb[:0], max(rep.CostMicros, 0), 10)
	n := len(t) + 1 + len(c) + 1 + len(spec) + 1 + len(rep.Event)
	a.b = append(a.b, '$')
	a.b = strconv.AppendInt(a.b, int64(n), 10)
	a.b = append(a.b, '\r', '\n')
	a.b = append(a.b, t...)
	a.b = append(a.b, ' ')
	a.b = append(a.b, c...)
	a.b = append(a.b, '\n')
	a.b = append(a.b, spec...)
	a.b = append(a.b, '\n')
	a.b = append(a.b, rep.Event...)
	a.b = append(a.b, '\r', '\n')
	a.n++
}

// RenewReport renews the lease like Renew and replaces the request's
// report with rep (the usage seen so far). For a lease admitted without a
// Report it is Renew.
func (l *Limiter) RenewReport(ctx context.Context, lease *Lease, rep Report) (RenewState, error) {
	if s := lease.sweep; s != nil {
		s.setReport(rep)
	}
	return l.Renew(ctx, lease)
}

// Sweepable reports whether the lease was admitted with a Report.
func (l *Lease) Sweepable() bool { return l.sweep != nil }

// The scopes spec: "1" then, per scope, " <kind> <len>:<id> <flags>
// <budget>", where flags is 1 (rpm) | 2 (tpm) | 4 (parallel) and budget is
// "-" or "<window>,<cap>,<soft>" (budgets carry no seeds: a missing
// window is seeded from the ledger, seed.go). The id is
// length-prefixed, so it may hold any byte.
const specVersion = "1"

func encodeSpec(scopes []Scope) string {
	if len(scopes) == 0 {
		return specVersion // a request admitted entirely from slices
	}
	var b strings.Builder
	b.Grow(32 * len(scopes))
	b.WriteString(specVersion)
	for _, s := range scopes {
		b.WriteByte(' ')
		b.WriteString(s.Kind)
		b.WriteByte(' ')
		b.WriteString(strconv.Itoa(len(s.ID)))
		b.WriteByte(':')
		b.WriteString(s.ID)
		flags := 0
		if s.RPM > 0 {
			flags |= 1
		}
		if s.TPM > 0 {
			flags |= 2
		}
		if s.MaxParallel > 0 {
			flags |= 4
		}
		b.WriteByte(' ')
		b.WriteString(strconv.Itoa(flags))
		b.WriteByte(' ')
		if s.Budget == nil {
			b.WriteByte('-')
			continue
		}
		bd := s.Budget
		b.WriteString(bd.Window)
		for _, v := range []int64{bd.CapMicros, bd.SoftMicros} {
			b.WriteByte(',')
			b.WriteString(strconv.FormatInt(v, 10))
		}
	}
	return b.String()
}

var errBadSpec = errors.New("malformed scopes spec")

// decodeSpec parses encodeSpec's output.
func decodeSpec(s string) ([]Scope, error) {
	scopes, rest, err := decodeSpecPrefix(s)
	if err == nil && rest != "" {
		err = fmt.Errorf("%w: trailing %q", errBadSpec, rest)
	}
	return scopes, err
}

// decodeSpecPrefix parses the spec at the start of s and returns what
// follows it (a spec ends where no " <scope>" follows; ids may hold any
// byte, so the spec's end is found by parsing, not by a separator).
// Limits are set to 1 where the flags say the scope had one: settling
// needs only which limits a scope has, not their values.
func decodeSpecPrefix(s string) ([]Scope, string, error) {
	word := func() (string, bool) {
		if s == "" || s[0] != ' ' {
			return "", false
		}
		s = s[1:]
		i := strings.IndexAny(s, " \n")
		if i < 0 {
			i = len(s)
		}
		w := s[:i]
		s = s[i:]
		return w, w != ""
	}
	v, ok := strings.CutPrefix(s, specVersion)
	if !ok {
		return nil, "", fmt.Errorf("%w: version", errBadSpec)
	}
	s = v
	var out []Scope
	for s != "" && s[0] == ' ' {
		kind, ok := word()
		if !ok || !validKinds[kind] {
			return nil, "", fmt.Errorf("%w: kind", errBadSpec)
		}
		if s == "" || s[0] != ' ' {
			return nil, "", fmt.Errorf("%w: id", errBadSpec)
		}
		colon := strings.IndexByte(s, ':')
		n, err := strconv.Atoi(s[1:max(colon, 1)])
		if colon < 0 || err != nil || n <= 0 || colon+1+n > len(s) {
			return nil, "", fmt.Errorf("%w: id length", errBadSpec)
		}
		sc := Scope{Kind: kind, ID: s[colon+1 : colon+1+n]}
		s = s[colon+1+n:]
		fw, ok := word()
		flags, err := strconv.Atoi(fw)
		if !ok || err != nil || flags < 0 || flags > 7 {
			return nil, "", fmt.Errorf("%w: flags", errBadSpec)
		}
		if flags&1 != 0 {
			sc.RPM = 1
		}
		if flags&2 != 0 {
			sc.TPM = 1
		}
		if flags&4 != 0 {
			sc.MaxParallel = 1
		}
		bw, ok := word()
		if !ok {
			return nil, "", fmt.Errorf("%w: budget", errBadSpec)
		}
		if bw != "-" {
			f := strings.Split(bw, ",")
			if len(f) != 3 {
				return nil, "", fmt.Errorf("%w: budget", errBadSpec)
			}
			var nums [2]int64
			for i := range nums {
				if nums[i], err = strconv.ParseInt(f[i+1], 10, 64); err != nil {
					return nil, "", fmt.Errorf("%w: budget amount", errBadSpec)
				}
			}
			if _, err := budget.ParseWindow(f[0]); err != nil {
				return nil, "", fmt.Errorf("%w: budget window: %w", errBadSpec, err)
			}
			sc.Budget = &Budget{Window: f[0], CapMicros: nums[0], SoftMicros: nums[1]}
		}
		out = append(out, sc)
	}
	return out, s, nil
}
