package limits

import (
	"fmt"
	"regexp"
	"strconv"
	"time"
)

// windowPattern matches the budget windows the admin API accepts
// (controlplane/internal/admin.ParseBudgetDuration).
var windowPattern = regexp.MustCompile(`^([1-9][0-9]{0,3})(h|d|mo)$`)

// budgetUnit is a parsed budget window: n units of "h", "d" or "mo".
type budgetUnit struct {
	unit string
	n    int64
}

// parseWindow parses a budget window string ("<n>h", "<n>d", "<n>mo").
func parseWindow(s string) (budgetUnit, error) {
	m := windowPattern.FindStringSubmatch(s)
	if m == nil {
		return budgetUnit{}, fmt.Errorf("budget window %q: want <n>h, <n>d or <n>mo", s)
	}
	n, _ := strconv.ParseInt(m[1], 10, 64)
	return budgetUnit{unit: m[2], n: n}, nil
}

// BudgetWindow returns the budget window of the given length ("<n>h",
// "<n>d", "<n>mo") that contains t: "<n>h" and "<n>d" are fixed windows of
// that length aligned to the Unix epoch (UTC); "<n>mo" are runs of n calendar
// months in UTC counted from January 1970 (so 1mo, 3mo, 6mo and 12mo start on
// the first of a month, quarter, half-year and year). It is the Go mirror of
// budget_window in lua/common.lua — whoever computes the durable spend of a
// window (the seed) must use the same boundaries.
func BudgetWindow(window string, t time.Time) (start, end time.Time, err error) {
	w, err := parseWindow(window)
	if err != nil {
		return time.Time{}, time.Time{}, err
	}
	t = t.UTC()
	switch w.unit {
	case "h", "d":
		length := w.n * 3600
		if w.unit == "d" {
			length = w.n * 86400
		}
		idx := floorDiv(t.Unix(), length)
		return time.Unix(idx*length, 0).UTC(), time.Unix((idx+1)*length, 0).UTC(), nil
	default:
		months := int64(t.Year()-1970)*12 + int64(t.Month()-1)
		sm := floorDiv(months, w.n) * w.n
		first := func(m int64) time.Time {
			return time.Date(1970+int(floorDiv(m, 12)), time.Month(m-floorDiv(m, 12)*12+1), 1, 0, 0, 0, 0, time.UTC)
		}
		return first(sm), first(sm + w.n), nil
	}
}

func floorDiv(a, b int64) int64 {
	q := a / b
	if (a%b != 0) && ((a < 0) != (b < 0)) {
		q--
	}
	return q
}
