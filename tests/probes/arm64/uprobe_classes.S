// One function per instruction class for a uprobe on arm64
// (tests/probes/arm64/uprobe_cost.py): the probe goes on the instruction at
// the label u_<name>; the table below names them for the C driver.
	.text
	.macro fn name
	.globl \name
	.type \name, %function
	.p2align 4
\name:
	.endm

fn f_cbz            // simulated: cbz/cbnz
	.globl u_cbz
u_cbz:	cbz x0, 1f
1:	ret
fn f_adrp           // simulated: adr/adrp
	.globl u_adrp
u_adrp:	adrp x1, f_adrp
	ret
fn f_stp            // stepped out of line: the glibc malloc entry
	.globl u_stp
u_stp:	stp x29, x30, [sp, #-16]!
	ldp x29, x30, [sp], #16
	ret
fn f_mov            // stepped out of line
	.globl u_mov
u_mov:	mov x1, x0
	ret
fn f_nop            // stepped before 6.13, simulated since
	.globl u_nop
u_nop:	nop
	ret
fn f_bti            // hint on the steppable list
	.globl u_bti
u_bti:	hint #34            // bti c
	ret
fn f_paciasp        // hint on the steppable list; signs x30
	.globl u_paciasp
u_paciasp:	hint #25        // paciasp
	hint #29                // autiasp
	ret
fn f_autiasp        // hint off the list: refused
	hint #25
	.globl u_autiasp
u_autiasp:	hint #29
	ret
fn f_ldrlit         // literal load: refused since the 2024 fix
	.globl u_ldrlit
u_ldrlit:	ldr x1, 2f
	ret
	.p2align 3
2:	.quad 42
fn f_ldxr           // exclusive: refused
	.globl u_ldxr
u_ldxr:	ldxr x1, [x0]
	clrex
	ret
