package limits

import (
	"context"
	_ "embed"
	"fmt"

	"github.com/sluicegw/sluice/internal/budget"
)

//go:embed lua/peek.lua
var peekLua string

var peekScript = newScript(commonLua + "\n" + peekLua)

// Budget states of a Headroom.
const (
	BudgetNone      = ""
	BudgetCurrent   = "current"
	BudgetNewWindow = "new_window"
	BudgetNotHeld   = "not_in_redis"
)

// Headroom is what a scope's Redis state holds now: the requests and
// tokens in its sliding windows, its live leases and its budget window's
// spend.
type Headroom struct {
	Requests, Tokens, Leases int64
	// BudgetState is one of the Budget constants; SpendMicros is the
	// window's spend when it is BudgetCurrent (zero otherwise).
	BudgetState string
	SpendMicros int64
	// Prefill is the scope's prefill tokens in flight (Request.Prefill
	// accounts them; a deployment's max_concurrency scope holds its
	// fleet-wide count).
	Prefill int64
}

// Peek reads the headroom of scopes of org without writing anything (one
// read-only script call): no epoch is started, no window pruned, no
// budget window begun. It is for explaining decisions (docs/explain.md),
// never for admission.
func (l *Limiter) Peek(ctx context.Context, orgID string, scopes []Scope) ([]Headroom, error) {
	if !validTagPart(orgID) {
		return nil, fmt.Errorf("%w: org id %q", ErrInvalidRequest, orgID)
	}
	if len(scopes) == 0 {
		return nil, nil
	}
	kb := newKeyBuilder(l.cfg.KeyPrefix, orgID)
	keys := make([]string, 0, keysPerScope*len(scopes))
	a := newArgv()
	defer a.release()
	a.int(ms(l.cfg.rateWindow))
	a.int(ms(l.cfg.rateBucket))
	a.int(int64(len(scopes)))
	for i := range scopes {
		sk := kb.scope(&scopes[i])
		keys = append(keys, sk[:]...)
		b := scopes[i].Budget
		if b == nil {
			a.str("-")
			a.int(0)
			continue
		}
		u, err := budget.ParseWindow(b.Window)
		if err != nil {
			return nil, fmt.Errorf("%w: budget window %q: %w", ErrInvalidRequest, b.Window, err)
		}
		a.str(u.Unit)
		a.int(u.N)
	}
	v, err := l.run(ctx, peekScript, "peek", keys, a)
	if err != nil {
		return nil, err
	}
	const perScope = 6
	if len(v) != perScope*len(scopes) {
		return nil, fmt.Errorf("limits peek: %d values for %d scopes", len(v), len(scopes))
	}
	out := make([]Headroom, len(scopes))
	for i := range out {
		w := v[perScope*i:]
		out[i] = Headroom{Requests: w[0], Tokens: w[1], Leases: w[2], SpendMicros: w[4], Prefill: w[5],
			BudgetState: [...]string{BudgetNone, BudgetCurrent, BudgetNewWindow, BudgetNotHeld}[min(max(w[3], 0), 3)]}
	}
	return out, nil
}
