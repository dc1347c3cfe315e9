// Package budget holds what both planes must agree on about budgets:
// the boundaries of budget windows (budget_duration) and the ids of
// limit scopes. The data plane counts spend per scope and window in Redis
// (dataplane/internal/limits); the control plane computes the durable
// spend of the same scope and window from the ledger (the seed carried in
// snapshots). Both use these functions, so the two can never disagree.
package budget

import (
	"fmt"
	"time"
)

// ParseWindow accepts what the admin API accepts
// (controlplane/internal/admin.ParseBudgetDuration): ^([1-9][0-9]{0,3})(h|d|mo)$.
// It is on the request path (every budgeted scope of every request), so
// it is parsed by hand rather than by a regular expression.

// Unit is a parsed budget window: N units of "h", "d" or "mo".
type Unit struct {
	Unit string
	N    int64
}

// ParseWindow parses a budget window string ("<n>h", "<n>d", "<n>mo").
func ParseWindow(s string) (Unit, error) {
	i := 0
	var n int64
	for i < len(s) && i < 4 && s[i] >= '0' && s[i] <= '9' {
		n = n*10 + int64(s[i]-'0')
		i++
	}
	if i == 0 || s[0] == '0' {
		return Unit{}, fmt.Errorf("budget window %q: want <n>h, <n>d or <n>mo", s)
	}
	switch s[i:] {
	case "h":
		return Unit{Unit: "h", N: n}, nil
	case "d":
		return Unit{Unit: "d", N: n}, nil
	case "mo":
		return Unit{Unit: "mo", N: n}, nil
	}
	return Unit{}, fmt.Errorf("budget window %q: want <n>h, <n>d or <n>mo", s)
}

// Window returns the budget window of the given length ("<n>h", "<n>d",
// "<n>mo") that contains t: "<n>h" and "<n>d" are fixed windows of that
// length aligned to the Unix epoch (UTC); "<n>mo" are runs of n calendar
// months in UTC counted from January 1970 (so 1mo, 3mo, 6mo and 12mo start
// on the first of a month, quarter, half-year and year). It is the Go
// mirror of budget_window in dataplane/internal/limits/lua/common.lua.
func Window(window string, t time.Time) (start, end time.Time, err error) {
	w, err := ParseWindow(window)
	if err != nil {
		return time.Time{}, time.Time{}, err
	}
	t = t.UTC()
	switch w.Unit {
	case "h", "d":
		length := w.N * 3600
		if w.Unit == "d" {
			length = w.N * 86400
		}
		idx := floorDiv(t.Unix(), length)
		return time.Unix(idx*length, 0).UTC(), time.Unix((idx+1)*length, 0).UTC(), nil
	default:
		months := int64(t.Year()-1970)*12 + int64(t.Month()-1)
		sm := floorDiv(months, w.N) * w.N
		first := func(m int64) time.Time {
			return time.Date(1970+int(floorDiv(m, 12)), time.Month(m-floorDiv(m, 12)*12+1), 1, 0, 0, 0, 0, time.UTC)
		}
		return first(sm), first(sm + w.N), nil
	}
}

func floorDiv(a, b int64) int64 {
	q := a / b
	if (a%b != 0) && ((a < 0) != (b < 0)) {
		q--
	}
	return q
}

// Scope kinds: the levels of SPEC §3 (projects and tags included), the
// per-model scopes of keys and teams, and deployments.
const (
	KindKey      = "key"
	KindUser     = "user"
	KindMember   = "member"
	KindTeam     = "team"
	KindOrg      = "org"
	KindCustomer = "customer"
	// KindProject and KindTag are the project and tag scopes of an org
	// (their id is the label scope's id, not the label).
	KindProject    = "project"
	KindTag        = "tag"
	KindKeyModel   = "key_model"
	KindTeamModel  = "team_model"
	KindDeployment = "deployment"
)

// MemberID is the scope id of a team membership.
func MemberID(teamID, userID string) string { return teamID + "/" + userID }

// ModelID is the scope id of a per-model limit of a key or team: the
// owner's id and the model group the request resolved to.
func ModelID(ownerID, modelGroup string) string { return ownerID + "/" + modelGroup }

// Micros converts USD to micro-USD, rounding up so a cap or a price is
// never understated.
func Micros(usd float64) int64 {
	if usd <= 0 {
		return 0
	}
	m := usd * 1e6
	i := int64(m)
	if float64(i) < m {
		i++
	}
	return i
}
