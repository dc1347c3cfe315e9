package limits

import (
	_ "embed"
)

// The scripts share lua/common.lua, which is prepended to each of them; the
// SHA sent with EVALSHA is that of the combined text.
var (
	//go:embed lua/common.lua
	commonLua string
	//go:embed lua/admit.lua
	admitLua string
	//go:embed lua/renew.lua
	renewLua string
	//go:embed lua/settle.lua
	settleLua string
	//go:embed lua/seed.lua
	seedLua string
	//go:embed lua/carve.lua
	carveLua string
	//go:embed lua/slicerec.lua
	sliceRecLua string
	//go:embed lua/reclaim.lua
	reclaimLua string

	admitScript  = newScript(commonLua + "\n" + admitLua)
	renewScript  = newScript(commonLua + "\n" + renewLua)
	settleScript = newScript(commonLua + "\n" + settleLua)
	seedScript   = newScript(commonLua + "\n" + seedLua)
	carveScript  = newScript(commonLua + "\n" + carveLua)
	// sliceRecScript writes the record of a long request admitted from
	// quota slices (slices.go).
	sliceRecScript = newScript(commonLua + "\n" + sliceRecLua)
	// reclaimScript reclaims expired budget leases of quota slices
	// (sweep.go).
	reclaimScript = newScript(commonLua + "\n" + reclaimLua)
)
