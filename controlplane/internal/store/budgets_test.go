package store

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestBudgetRangesSplitWholeDaysFromEdges(t *testing.T) {
	t.Parallel()
	at := func(s string) time.Time {
		tm, err := time.Parse(time.RFC3339, s)
		require.NoError(t, err)
		return tm
	}
	for _, c := range []struct {
		name, start, end, dayFrom, dayTo string
	}{
		{"a month: all days", "2026-11-01T00:00:00Z", "2026-12-01T00:00:00Z", "2026-11-01T00:00:00Z", "2026-12-01T00:00:00Z"},
		{"36h from noon", "2026-11-16T12:00:00Z", "2026-11-18T00:00:00Z", "2026-11-17T00:00:00Z", "2026-11-18T00:00:00Z"},
		{"36h to noon", "2026-11-30T00:00:00Z", "2026-12-01T12:00:00Z", "2026-11-30T00:00:00Z", "2026-12-01T00:00:00Z"},
		{"60h, both edges partial", "2026-11-14T12:00:00Z", "2026-11-17T00:00:00Z", "2026-11-15T00:00:00Z", "2026-11-17T00:00:00Z"},
		{"12h over midnight: no whole day", "2026-11-16T18:00:00Z", "2026-11-17T06:00:00Z", "2026-11-17T00:00:00Z", "2026-11-17T00:00:00Z"},
		{"1h inside a day: logs only", "2026-11-17T10:00:00Z", "2026-11-17T11:00:00Z", "2026-11-17T11:00:00Z", "2026-11-17T11:00:00Z"},
	} {
		from, to := budgetRanges(at(c.start), at(c.end))
		require.Equal(t, at(c.dayFrom), from, c.name)
		require.Equal(t, at(c.dayTo), to, c.name)
	}
}
